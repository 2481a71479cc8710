"""`dfcache import` checks the declared layer convention on one recomputed sample.

Off-by-one layer ids are the field's most repeated bug (onnxruntime-genai #2538, speculators
#705, sglang #32204, vllm #42704, ModelOpt #2149, BaldEagle #18): the conventions differ by one
layer or by the final norm, and nothing in a SpecForge, speculators or ModelOpt file says which
one its states follow. dfcache's layer id k is the output of decoder layer k, before the final
norm (transformers' ``hidden_states[k+1]``; docs/cli.md). The usual neighbours of a declared k:

* k-1, the *input* of layer k: EAGLE-3 captures layer inputs, vLLM's ``extract_hidden_states`` (so
  speculators' ``aux_hidden_state_layer_ids``) and SGLang's capture lists count them that way, and
  so does a transformers ``hidden_states`` index used as a layer id; SpecForge subtracts one before
  handing its ids to SGLang (``prepare_hidden_states.py``), a pipeline that does not is one off;
* k+1, the same shift the other way (ids already converted, converted once more);
* for the last layer, the state after the final norm (transformers' last ``hidden_states`` entry,
  EAGLE-1's ``hidden_state``), which no decoder-layer id names (vLLM and SGLang's #32204 fix take it
  before the norm); for layer 0, the embedding output (``hidden_states[0]``, the input of layer 0).

A SpecForge file's final state (EAGLE-3's ``hidden_state``, DSpark's ``target_last_hidden_states``)
is imported as dfcache's layer ``"final"`` and checked here too: its column must be nearest the
final norm's output (:func:`candidate_name`).

Before anything is written, one sample (the shortest good one, its first ``CHECK_TOKENS`` tokens:
states are causal, so a prefix's states are the sample's own first rows) is recomputed with the
declared target on the CPU with the torch kernels, in the files' dtype, and every column of the
file is compared with every layer up to one past the deepest declared one, plus those two
states. A column keeps its declared layer when that layer is the nearest and within the
tolerance; otherwise the import is refused (exit 6) naming what each column matches.

The distance is the median over tokens of the per-token relative L2 error: robust to the few
tokens (the first, delimiters) whose massive activations dominate a global norm and are nearly
the same in every layer. Tolerances, measured (see :data:`TOLERANCE_SAME`, :data:`TOLERANCE_CROSS`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from dfcache.errors import BadInputError

CHECK_TOKENS = 256
# Recomputed with the declared class itself (torch on the CPU, the files' dtype and attention):
# the stored rows are a one-sample forward's bits (stages/hidden_states/extract.py), and on the
# tiny target a recomputed sample, whole or its first 64 tokens, was bitwise equal in bf16 and
# fp32 (distance 0). The bounds are `verify --recompute`'s (runner/peers/recompute.py), so the two
# checks agree on what "the same class" tolerates.
TOLERANCE_SAME = {"bfloat16": 1e-2, "float32": 1e-4}
# Recomputed on the CPU for states declared from a GPU class (fla or torch on CUDA): the kernels
# differ, so the rows do too. Measured: bf16 states against a float32 recomputation, 2.8e-3
# (layer 0) to 6.2e-3 (layer 5) on the tiny target; two bf16 GPU kernel classes (packed varlen
# vs one-sample forwards, random 1.25 B, H200) up to 1.4e-2 (global rel L2) at layer 13
# (docs/benchmarks.md). Adjacent layers of the tiny target are 5.1e-2 apart, the closest distinct
# states measured; 3e-2 is twice the largest kernel difference and below that
# (tests/test_training.py::test_layer_check_tolerance_lies_between_kernel_rounding_and_the_next_layer).
# A column is matched to its nearest candidate in any case, so the tolerance decides only
# between "this convention" and "none of them" (another model, backend or layer order).
TOLERANCE_CROSS = 3e-2


@dataclass(frozen=True)
class Candidate:
    name: str  # "layer 3", "embeddings", "final norm"
    layer: int | None  # the dfcache layer id it is, None for states no id names
    why: str = ""  # how a pipeline comes to hold these states under the declared id (for messages)


@dataclass
class ColumnCheck:
    column: int
    declared: int
    nearest: str
    layer: int | None  # the dfcache id of the nearest candidate (None: no id names it)
    distance: float  # to the nearest
    declared_distance: float
    distances: dict[str, float]
    ok: bool

    def to_dict(self) -> dict:
        return {"column": self.column, "declared": self.declared, "nearest": self.nearest, "layer": self.layer,
                "distance": self.distance, "declared_distance": self.declared_distance, "ok": self.ok,
                "distances": self.distances}


@dataclass
class LayerCheck:
    sample: str
    tokens: int
    recomputed_with: str
    same_class: bool
    tolerance: float
    columns: list[ColumnCheck] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.columns)

    def to_dict(self) -> dict:
        return {"checked": True, "ok": self.ok, "sample": self.sample, "tokens": self.tokens,
                "recomputed_with": self.recomputed_with, "same_class": self.same_class,
                "tolerance": self.tolerance, "metric": "median per-token relative L2",
                "columns": [c.to_dict() for c in self.columns]}



def summary_of(check: dict) -> str:
    """One line for a passed check (:meth:`LayerCheck.to_dict`): each layer's distance and the next
    nearest candidate's, so the margin shows."""
    parts = []
    for c in check["columns"]:
        others = sorted((d, n) for n, d in c["distances"].items() if n != c["nearest"])
        nxt = f" (next: {others[0][1]}, {others[0][0]:.1e})" if others else ""
        parts.append(f"layer {c['declared']} {c['declared_distance']:.1e}{nxt}")
    return (f"layers checked on {check['sample']} ({check['tokens']} tokens recomputed, {check['recomputed_with']}; "
            f"median per-token rel L2, tolerance {check['tolerance']:g}): " + "; ".join(parts))


def candidate_name(k) -> str:
    """The candidate a declared id names: ``layer k``, or for the final state (layer "final",
    imported from files that carry it) the final norm's output."""
    from ..models.target import FINAL

    return "final norm" if k == FINAL else f"layer {k}"


def candidates(declared: list, num_layers: int) -> list[Candidate]:
    """Every layer up to one past the deepest declared one, the embedding output where layer 0
    is declared, and the final norm's output where one of the last two layers (or the final
    state) is."""
    from ..models.target import FINAL

    final = FINAL in declared
    declared = [k for k in declared if k != FINAL] or [num_layers - 1]
    deepest = min(num_layers - 1, max(declared) + 1)
    out = [Candidate(f"layer {c}", c) for c in range(deepest + 1)]
    if 0 in declared:
        out.append(Candidate("embeddings", None, "the embedding output (transformers' hidden_states[0], the input "
                                                 "of layer 0)"))
    if final or max(declared) >= num_layers - 2:
        out.append(Candidate("final norm", None, f"the last layer after the final norm (transformers' last "
                                                 f"hidden_states entry, hidden_states[{num_layers}], as it "
                                                 "returns it)"))
    return out


def distance(stored: np.ndarray, fresh: np.ndarray) -> float:
    """Median over tokens of ||stored_t - fresh_t|| / ||stored_t|| (float64)."""
    a, b = stored.astype(np.float64), fresh.astype(np.float64)
    num = np.linalg.norm(a - b, axis=1)
    den = np.linalg.norm(a, axis=1)
    rel = np.where(den > 0, num / np.where(den > 0, den, 1.0), np.where(num > 0, np.inf, 0.0))
    return float(np.median(rel)) if len(rel) else 0.0


def recompute(target_dir, backend, ids: np.ndarray, cands: list[Candidate]) -> dict[str, np.ndarray]:
    """Each candidate's states for ``ids`` [t] (float32 [t, hidden]), one forward on ``backend``."""
    import torch

    from ..models.target import FINAL, load_target

    model = load_target(target_dir, backend)
    layers = [c.layer for c in cands if c.layer is not None]
    final = any(c.name == "final norm" for c in cands)
    captured: dict[str, object] = {}

    def first_input(module, args, kwargs):
        captured["embeddings"] = args[0] if args else kwargs["hidden_states"]

    hook = model.layers[0].register_forward_pre_hook(first_input, with_kwargs=True) \
        if any(c.name == "embeddings" for c in cands) else None
    try:
        out = model.forward_layers(torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)).unsqueeze(0),
                                   layers + ([FINAL] if final else []))
    finally:
        if hook is not None:
            hook.remove()
    got = {f"layer {k}": out[k] for k in layers}
    if "embeddings" in captured:
        got["embeddings"] = captured["embeddings"]
    if final:  # the base model's output: the last layer after the final norm, in the same forward
        got["final norm"] = out[FINAL]
    return {name: t[0].detach().to("cpu", torch.float32).numpy() for name, t in got.items()}


def check_columns(hidden: np.ndarray, declared: list[int], fresh: dict[str, np.ndarray], cands: list[Candidate],
                  tolerance: float) -> list[ColumnCheck]:
    """Compare each declared column of ``hidden`` [t, layers x width] (float32) with every
    recomputed candidate; a column is ok when its declared layer is the nearest and within
    ``tolerance``."""
    width = hidden.shape[1] // len(declared)
    by_name = {c.name: c for c in cands}
    out = []
    for j, k in enumerate(declared):
        col = hidden[:, j * width:(j + 1) * width]
        dist = {name: distance(col, v) for name, v in fresh.items()}
        name = candidate_name(k)
        nearest = min(dist, key=lambda n: (dist[n], n != name))
        mine = dist.get(name, float("inf"))
        out.append(ColumnCheck(column=j, declared=k, nearest=nearest, layer=by_name[nearest].layer,
                               distance=dist[nearest], declared_distance=mine, distances=dist,
                               ok=nearest == name and mine <= tolerance))
    return out


def _convention(c: ColumnCheck, cands: dict[str, Candidate]) -> str:
    """What the states of a column that does not hold its declared layer are, in words."""
    k, got = c.declared, cands[c.nearest]
    if isinstance(k, str):  # the file's final state ("final"), which is not after the final norm
        return got.why if got.layer is None else f"layer {got.layer}, the output of decoder layer {got.layer}"
    if got.layer is None:
        return got.why + ", which no dfcache layer id names"
    if got.layer == k - 1:
        return (f"layer {k - 1}, the output of decoder layer {k - 1}: the input of layer {k}, which EAGLE-3, vLLM's "
                f"extract_hidden_states (speculators' aux_hidden_state_layer_ids) and a transformers hidden_states "
                f"index call {k}")
    if got.layer == k + 1:
        return f"layer {k + 1}, the output of decoder layer {k + 1}: one layer after the declared one"
    return f"layer {got.layer}"


def refusal(check: LayerCheck, cands: list[Candidate], fmt: str, root) -> BadInputError:
    """The exit-6 error of a check that failed: per column what it matches, and the fix."""
    by_name = {c.name: c for c in cands}
    lines = [f"the {fmt} states under {root} do not hold the declared layers: {check.sample} recomputed with the "
             f"declared target ({check.tokens} tokens, {check.recomputed_with}) gives"]
    matched: list[int | None] = []
    for c in check.columns:
        if c.ok:
            matched.append(c.declared)
            continue
        head = f"  - column {c.column} (declared layer {c.declared}): "
        if c.distance <= check.tolerance:
            lines.append(head + f"matches {_convention(c, by_name)} (median per-token rel L2 {c.distance:.1e}; "
                                f"the declared layer {c.declared_distance:.1e})")
            matched.append(c.layer)
        elif c.nearest == candidate_name(c.declared):
            of = "this backend class" if check.same_class else "a CPU recomputation"
            lines.append(head + f"nearest is the declared layer, but at {c.distance:.1e}, over the tolerance "
                                f"{check.tolerance:g} of {of}: the states were made by another backend class or "
                                "model than declared")
            matched.append(None)
        else:
            lines.append(head + f"matches no layer convention (nearest: {c.nearest} at {c.distance:.1e}, over the "
                                f"tolerance {check.tolerance:g}): another model or backend than declared")
            matched.append(None)
    if any(not c.ok and isinstance(c.declared, str) for c in check.columns):
        lines.append("The files' final state (SpecForge's hidden_state or target_last_hidden_states) must be the "
                     "target's last layer after its final norm, what its lm_head reads: make them with the target "
                     "they were declared for.")
    elif all(m is not None for m in matched):
        lines.append("Import them with the layers they hold: " + " ".join(f"--layer {m}" for m in matched
                                                                           if not isinstance(m, str))
                     + " (dfcache numbering: the output of decoder layer k, before the final norm).")
    elif any(by_name[c.nearest].layer is None and c.distance <= check.tolerance for c in check.columns):
        lines.append("States no dfcache layer id names cannot be imported as one: make the files with the output of "
                     "the last decoder layer before the final norm (vLLM's extract_hidden_states takes it so, and "
                     "SGLang since #32204), or leave that layer out.")
    else:
        lines.append("Declare what made the files: --target, --backend, --device (and --layer).")
    lines.append("--no-check imports them as declared, marked unchecked.")
    err = BadInputError("\n".join(lines))
    err.layer_check = check
    return err
