"""`dfcache verify --recompute N`: re-extract N samples of imported hidden states and compare.

An import is keyed by what the user *declared* (target, layer ids in file order, backend class);
nothing in the peers' files proves it. Recomputing a few samples with that declaration (the same
target, the declared backend, each sample alone in one forward) and comparing them with the
imported rows shows whether the declaration holds: a wrong layer order, another model or another
backend gives states that differ by far more than kernel rounding.

Which samples: ``N`` spread evenly over each imported set (first and last included), so the
choice is deterministic. Per sample and layer it reports relative L2 error, max absolute
difference, min per-token cosine and the share of bitwise-equal elements. A sample *agrees* when
its relative L2 error is at most ``TOLERANCE[dtype]`` (bf16: 1e-2, float32: 1e-4) on every layer:
rounding differences of one backend class (batch composition, kernel order) stay far below it,
while states of another layer or model are of the order of 1 apart. Any disagreement is exit 5.

Registered as the ``hidden_states`` recomputer of ``dfcache verify`` (dfcache.cli.common.state),
so ``dfcache`` itself stays free of models.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from dfcache.errors import BadInputError, UsageError

TOLERANCE = {"bfloat16": 1e-2, "float32": 1e-4}


@dataclass
class LayerAgreement:
    layer: int
    rel_l2: float
    max_abs: float
    cos_min: float
    equal: float  # share of bitwise-equal elements

    def to_dict(self) -> dict:
        return {"layer": self.layer, "rel_l2": self.rel_l2, "max_abs": self.max_abs, "cos_min": self.cos_min,
                "equal": self.equal}


@dataclass
class SampleAgreement:
    index: int
    id: str
    tokens: int
    layers: list[LayerAgreement]
    agrees: bool

    def to_dict(self) -> dict:
        return {"index": self.index, "id": self.id, "tokens": self.tokens, "agrees": self.agrees,
                "layers": [x.to_dict() for x in self.layers]}


@dataclass
class SetAgreement:
    tokens_key: str
    layers: list[int]
    layer_keys: list[str]
    backend: dict
    samples_in_set: int
    tolerance: float
    samples: list[SampleAgreement] = field(default_factory=list)

    @property
    def agrees(self) -> bool:
        return all(s.agrees for s in self.samples)

    def to_dict(self) -> dict:
        return {"tokens": self.tokens_key, "layers": self.layers, "layer_keys": self.layer_keys,
                "backend": self.backend, "samples_in_set": self.samples_in_set, "tolerance_rel_l2": self.tolerance,
                "recomputed": len(self.samples), "agrees": self.agrees,
                "samples": [s.to_dict() for s in self.samples]}


def _widen(raw: np.ndarray, dtype: str) -> np.ndarray:
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return raw.astype(np.float64)


def compare_rows(stored: np.ndarray, fresh: np.ndarray, dtype: str, layer: int) -> LayerAgreement:
    """Two [n, hidden] arrays in the storage dtype (bf16 as uint16 bits)."""
    equal = float(np.count_nonzero(stored == fresh)) / max(1, stored.size)
    a, b = _widen(stored, dtype), _widen(fresh, dtype)
    d = a - b
    na = math.sqrt(float(np.vdot(a, a)))
    rel = math.sqrt(float(np.vdot(d, d))) / na if na > 0 else (0.0 if not d.any() else math.inf)
    dot = np.einsum("ij,ij->i", a, b)
    den = np.sqrt(np.einsum("ij,ij->i", a, a)) * np.sqrt(np.einsum("ij,ij->i", b, b))
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = np.where(den > 0, dot / np.where(den > 0, den, 1.0), 1.0)
    return LayerAgreement(layer=layer, rel_l2=rel, max_abs=float(np.abs(d).max()) if d.size else 0.0,
                          cos_min=float(np.clip(cos, -1, 1).min()) if len(cos) else 1.0, equal=equal)


def spread(n_set: int, n: int) -> list[int]:
    """``n`` sample positions spread evenly over ``n_set`` (first and last included)."""
    if n >= n_set:
        return list(range(n_set))
    if n == 1:
        return [0]
    return sorted({round(i * (n_set - 1) / (n - 1)) for i in range(n)})


def imported_sets(store, keys: list[str]) -> list[tuple[str, dict, list[int], list[str], dict]]:
    """(set key, declared backend, layers, hidden-state keys or partitions, provenance) of every
    imported set among ``keys``: ``import`` artifacts (per-sample imports) and set-level imported
    hidden-state artifacts grouped by their tokens."""
    from ..models.target import layer_of_key, layer_order
    from .imports import IMPORT_STAGE, read_import

    out = []
    groups: dict[tuple, list] = {}
    for k in keys:
        m = store.manifest(k)
        prov = m.provenance or {}
        if m.stage == IMPORT_STAGE:
            doc = read_import(store, m.key)
            out.append((m.key, prov.get("declared_backend") or {}, list(doc["layers"]), list(doc["layer_partitions"]),
                        prov))
        elif m.stage == "hidden_states" and not m.samples and prov.get("imported"):
            backend = m.inputs.get("backend") or {}
            groups.setdefault((m.upstream.get("tokens"), tuple(sorted(backend.items()))), []).append(m)
    for (tok, b), ms in groups.items():
        ms = sorted(ms, key=lambda m: layer_order(layer_of_key(m.inputs["layer"])))
        out.append((tok, dict(b), [layer_of_key(m.inputs["layer"]) for m in ms], [m.key for m in ms], ms[0].provenance))
    return out


def _target_dir(store, set_key: str, target: str | None, provenance: dict, declared: str | None) -> str:
    from ..core.graph import RunContext
    from ..models.resolve import resolved_target
    from ..core.options import EvalOptions

    name = target or provenance.get("target_dir")
    if not name:
        raise UsageError(f"the import {set_key[:12]} does not record its target's directory; pass --target MODEL "
                         "(the model the import declared) to recompute it.")
    ctx = RunContext(store, EvalOptions(target=name), argv=["verify"])
    rt = resolved_target(ctx)
    if declared is not None and rt.fingerprint != declared:
        raise BadInputError(f"--target {name} is not the model the import {set_key[:12]} declared (fingerprint "
                            f"{rt.fingerprint[:12]}, declared {str(declared)[:12]}); pass that model.")
    return rt.dir


def recompute(store, keys: list[str], n: int, *, target: str | None = None, progress=None,
              log=None) -> list[SetAgreement]:
    """Recompute ``n`` samples of each imported set among ``keys`` (see the module docstring)."""
    import torch

    from ..stages.hidden_states.extract import _storage_view
    from ..models.target import KernelSpec, kernel_problem, load_target
    from ..core.samples import stored_selection

    out: list[SetAgreement] = []
    for set_key, backend, layers, layer_keys, prov in imported_sets(store, keys):
        bc = KernelSpec.from_key(backend)
        problem = kernel_problem(bc)
        if problem:
            raise BadInputError(f"recomputing the import {set_key[:12]} needs its declared backend {bc.label}: "
                                f"{problem}")
        sel = stored_selection(store, set_key, layers, backend=backend)
        src = sel.source()
        declared = store.manifest(layer_keys[0]).inputs.get("target") if store.has(layer_keys[0]) else None
        if declared is None:  # an import artifact: the target is in its layers' partition inputs
            from dfcache.samples import index_of

            segs = index_of(store).segments(layer_keys[0])
            declared = next((m.inputs.get("target") for m in segs.values()), None)
        tdir = _target_dir(store, set_key, target, prov or {}, declared)
        if log:
            log(f"recomputing {min(n, len(src))} of {len(src)} imported samples of {set_key[:12]} "
                f"(layers {layers}, {bc.label})")
        model = load_target(tdir, bc)
        model.check_layers(layers)
        res = SetAgreement(tokens_key=set_key, layers=layers, layer_keys=list(layer_keys),
                           backend=backend, samples_in_set=len(src), tolerance=TOLERANCE[bc.dtype])
        ids_of = getattr(src, "sample_ids", None) or [str(i) for i in range(len(src))]
        picks = spread(len(src), n)
        bar = progress(len(picks)) if progress else None
        for i in picks:
            ids = src.read_tokens(i)
            stored = src.read_layers(i)
            got = model.forward_layers(torch.from_numpy(ids).unsqueeze(0).to(model.device), layers)
            per_layer = [compare_rows(s, _storage_view(got[k][0].detach().to("cpu").contiguous()), bc.dtype, k)
                         for k, s in zip(layers, stored)]
            res.samples.append(SampleAgreement(index=i, id=str(ids_of[i]), tokens=len(ids), layers=per_layer,
                                               agrees=all(x.rel_l2 <= res.tolerance for x in per_layer)))
            if bar is not None:
                bar.update(1)
        if bar is not None:
            bar.close()
        out.append(res)
    return out


def format_agreement(sets: list[SetAgreement]) -> list[str]:
    lines = []
    for s in sets:
        ok = sum(x.agrees for x in s.samples)
        lines.append(f"RECOMPUTED {s.tokens_key[:12]} layers {s.layers} ({s.backend.get('kernel')}/"
                     f"{s.backend.get('device')}/{s.backend.get('dtype')}): {ok} of {len(s.samples)} sample(s) "
                     f"agree (rel L2 <= {s.tolerance:g}; {s.samples_in_set} in the set)")
        for x in s.samples:
            worst = max(x.layers, key=lambda a: a.rel_l2)
            lines.append(f"  {'ok  ' if x.agrees else 'DIFF'} sample {x.index} ({x.id}, {x.tokens} tokens): worst "
                         f"layer {worst.layer}: rel L2 {worst.rel_l2:.2e}, max abs {worst.max_abs:.3g}, "
                         f"min cos {worst.cos_min:.4f}, {worst.equal:.1%} bitwise equal")
    return lines


def verify_hook(store, keys: list[str], n: int, *, target: str | None = None, progress=None, log=None) -> dict:
    """What ``dfcache verify --recompute`` calls: {"sets": [...], "lines": [...], "disagree": [...]}."""
    sets = recompute(store, keys, n, target=target, progress=progress, log=log)
    disagree = [f"imported samples of {s.tokens_key[:12]} (layers {s.layers}) disagree with a "
                "recomputation under their declared target, layers and backend"
                for s in sets if not s.agrees]
    return {"sets": [s.to_dict() for s in sets], "lines": format_agreement(sets), "disagree": disagree,
            "fix": "the declaration is wrong (layer order, model, backend) or the files were made otherwise: delete "
                   "the import (dfcache gc --key KEY --yes) and import again with the right --layer/--backend/--target."}
