"""`dfcache import`: hidden states made by SpecForge, speculators or ModelOpt, into the store.

What is read (the peers' layouts, docs/cli.md):

* ``specforge``: every ``*.ckpt`` / ``*.ckpt.gz`` under DIR (``rows_*/data_{i}.ckpt``), a
  ``torch.save`` dict with ``input_ids`` [n], ``loss_mask`` [n] and ``hidden_states``
  [1, n, layers x hidden] (the DFlash capture layout), ordered by ``i``. Files that carry the
  target's final state as well (SpecForge's EAGLE-3 files: ``aux_hidden_state`` for the layers and
  ``hidden_state``; its DSpark files: ``hidden_states`` and ``target_last_hidden_states``) import it
  as the hidden-state layer ``"final"`` (after the final norm: runner/stages/hidden_states), checked
  on the recomputed sample like the declared layers;
* ``speculators``: ``hs_{i}.safetensors`` in DIR/hidden_states (or DIR) with ``token_ids`` [n] and
  ``hidden_states`` [n, layers, hidden]; loss masks from the prepared dataset in DIR when there is
  one (``state.json``, read with ``datasets``), else every token counts;
* ``modelopt``: ``*.pt`` in DIR (ModelOpt's ``compute_hidden_states_*.py``): ``input_ids`` [n] and
  ``aux_hidden_states`` [n, layers x hidden] (its ``hidden_states``, the final normed output, is
  not a decoder layer's and is not imported); no loss mask, so every token counts.

Nothing in the files says which layers, model or kernels made them: the user declares the
target (``--target``), the layer ids in file order (``--layer``, dfcache numbering: output of
decoder layer k) and the backend class (``--backend``, ``--device``). The declared layers are
checked before anything is written: one sample is recomputed on the CPU and each column must be
nearest to its declared layer, not to a neighbour (runner/peers/import_check.py); a declaration that
does not hold is refused (exit 6) naming the layers the columns hold. ``--no-check`` skips it and
marks the import unchecked. The files are loaded with
``torch.load(weights_only=True)`` (no arbitrary unpickling). Samples go into the store's
per-sample segments: each sample's ids and loss mask are a ``tokens`` sample of a root partition
(keyed by the target's tokenizer, marked imported; the sample named by the digest of its ids and
mask), and each layer's rows a ``hidden_states`` sample of the partition the extraction stage
keys over those tokens with the declared backend. Only samples the store lacks are written, so a
grown set, a subset or an overlapping directory reuses what an earlier import committed. The set
in file order is one small ``import`` artifact (its sample keys per partition), the key the user
reads it by. Everything is marked in provenance and summary, which `dfcache ls` shows:
``imported (layers checked against a recomputed sample)``, or with ``--no-check``
``imported (declared, not checked: --no-check)``; the import artifact's provenance holds the
check's figures (``layer_check``).

A sample that cannot be read whole, holds NaN or Inf, or whose lengths or width disagree with
its input ids and the declared layers is refused with its reason; the others are imported, and
the command then exits 6 with the list. Samples are committed in segments (whole or not at all);
the ``import`` artifact last.
"""

from __future__ import annotations

import gzip
import io
import re
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import xxhash

from dfcache.errors import BadInputError, UsageError

from ..core.graph import RunContext
from ..core.options import EvalOptions

FORMATS = ("specforge", "speculators", "modelopt")
# Keyed in the imported tokens partition (tokens_partition): never changes, whatever the check.
PROVENANCE = "imported (declared, not verified)"
CHECKED = "imported (layers checked against a recomputed sample)"
UNCHECKED = "imported (declared, not checked: --no-check)"
_INDEX = re.compile(r"(\d+)")


@dataclass
class Refused:
    file: str
    reason: str


@dataclass
class ImportResult:
    format: str
    samples: int
    refused: list[Refused]
    tokens_key: str | None
    layer_keys: dict[int, str]  # layer -> its hidden-state partition
    already: bool = False
    reused: int = 0  # samples that were in the store already (from any earlier import)
    notes: list[str] = field(default_factory=list)
    provenance: str = CHECKED
    layer_check: dict | None = None  # runner.peers.import_check.LayerCheck.to_dict(), or {"checked": False}

    def to_dict(self) -> dict:
        return {"format": self.format, "samples": self.samples, "tokens_key": self.tokens_key,
                "layer_keys": {str(k): v for k, v in self.layer_keys.items()}, "already_imported": self.already,
                "reused": self.reused,
                "refused": [{"file": r.file, "reason": r.reason} for r in self.refused],
                "provenance": self.provenance, "layer_check": self.layer_check, "notes": self.notes}


def _files(fmt: str, root: Path) -> list[Path]:
    def index(p: Path) -> tuple:
        m = _INDEX.findall(p.name)
        return (int(m[-1]) if m else -1, p.name)

    if fmt == "specforge":
        found = [p for p in root.rglob("*") if p.is_file() and p.name.endswith((".ckpt", ".ckpt.gz"))
                 and not p.name.startswith(".")]
    elif fmt == "speculators":
        base = root / "hidden_states" if (root / "hidden_states").is_dir() else root
        found = [p for p in base.glob("hs_*.safetensors")]
    else:
        found = [p for p in root.glob("*.pt") if not p.name.startswith(".")]
    return sorted(found, key=index)


def _torch_load(path: Path) -> dict:
    import torch

    if path.name.endswith(".gz"):
        with gzip.open(path, "rb") as f:
            return torch.load(io.BytesIO(f.read()), map_location="cpu", weights_only=True)
    return torch.load(path, map_location="cpu", weights_only=True)


def _prepared_masks(root: Path) -> list | None:
    if not (root / "state.json").exists():
        return None
    try:
        import datasets
    except ImportError:
        return None
    ds = datasets.load_from_disk(str(root)).with_format(None)
    return list(ds["loss_mask"]) if "loss_mask" in ds.column_names else None


def _read(fmt: str, path: Path, masks: list | None) -> tuple:
    """(input_ids, loss_mask or None, hidden [n, layers, hidden] as a torch tensor); raises ValueError."""
    import torch

    if fmt == "speculators":
        from safetensors.torch import load_file

        raw = load_file(str(path))
        need = ("token_ids", "hidden_states")
    else:
        raw = _torch_load(path)
        need = ("input_ids", "hidden_states") if fmt == "specforge" else ("input_ids", "aux_hidden_states")
    if not isinstance(raw, dict):
        raise ValueError(f"holds a {type(raw).__name__}, not a dict of tensors")
    pair = final_pair(raw) if fmt == "specforge" else None
    if pair is not None:
        need = ("input_ids", pair[0], pair[1])
    missing = [k for k in need if k not in raw]
    if missing:
        raise ValueError(f"lacks {', '.join(missing)} (it has {', '.join(map(str, raw))})")
    ids, hidden = raw[need[0]], raw[need[1]]
    if pair is not None:  # the final state as one more column, after the layers (layer "final")
        layers, final = (t[0] if isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[0] == 1 else t
                         for t in (raw[pair[0]], raw[pair[1]]))
        if not isinstance(layers, torch.Tensor) or not isinstance(final, torch.Tensor) or layers.dim() != 2 \
                or final.dim() != 2 or layers.shape[0] != final.shape[0] or layers.dtype != final.dtype:
            raise ValueError(f"{pair[0]} and {pair[1]} are not [n, width] tensors of one dtype and length")
        hidden = torch.cat([layers, final], dim=1)
    mask = raw.get("loss_mask") if fmt == "specforge" else None
    if fmt == "speculators" and masks is not None:
        index = int(path.stem[len("hs_"):])  # hs_{i} goes with row i of the prepared dataset
        if index >= len(masks):
            raise ValueError("has no row in the prepared dataset beside it")
        mask = torch.tensor(masks[index])
    if not isinstance(ids, torch.Tensor) or not isinstance(hidden, torch.Tensor):
        raise ValueError("input ids or hidden states are not tensors")
    return ids, mask, hidden


# SpecForge's files that carry the target's final state: (the layers' key, the final state's key).
FINAL_PAIRS = (("aux_hidden_state", "hidden_state"),  # EAGLE-3 (specforge.algorithms.eagle3.data)
               ("hidden_states", "target_last_hidden_states"))  # DSpark (dflash_family_data)


def final_pair(raw: dict) -> tuple[str, str] | None:
    """The keys of a SpecForge file's layers and final state, when it carries one."""
    for pair in FINAL_PAIRS:
        if pair[1] in raw:
            return pair
    return None


def _carries_final(fmt: str, path: Path) -> bool:
    if fmt != "specforge":
        return False
    try:
        raw = _torch_load(path)
    except Exception:  # unreadable: that file's refusal comes in pass 1
        return False
    return isinstance(raw, dict) and final_pair(raw) is not None


def _check(fmt, ids, mask, hidden, n_layers: int, width: int, vocab: int | None):
    """The sample as (int64 ids, int8 mask, hidden [n, n_layers * width]); raises ValueError."""
    import torch

    ids = ids.reshape(-1) if ids.dim() == 2 and ids.shape[0] == 1 else ids
    if ids.dim() != 1 or ids.dtype.is_floating_point:
        raise ValueError(f"input ids have shape {tuple(ids.shape)} {ids.dtype}, not [n] integers")
    n = int(ids.shape[0])
    if n == 0:
        raise ValueError("has no tokens")
    if vocab is not None and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"holds token id {int(ids.max())}, outside the target's vocabulary of {vocab}")
    if fmt == "speculators":
        if hidden.dim() != 3 or hidden.shape[1] != n_layers or hidden.shape[2] != width:
            raise ValueError(f"hidden states are {tuple(hidden.shape)}, expected [n, {n_layers} layers, {width}]")
        hidden = hidden.reshape(hidden.shape[0], n_layers * width)
    else:
        if hidden.dim() == 3 and hidden.shape[0] == 1:
            hidden = hidden[0]
        if hidden.dim() != 2 or hidden.shape[1] != n_layers * width:
            raise ValueError(f"hidden states are {tuple(hidden.shape)}, expected [n, {n_layers} layers x "
                             f"{width} = {n_layers * width}] (declare the layers it holds with --layer)")
    if hidden.shape[0] != n:
        raise ValueError(f"holds {hidden.shape[0]} rows of hidden states for {n} input ids")
    if hidden.dtype not in (torch.bfloat16, torch.float32):
        raise ValueError(f"hidden states are {hidden.dtype}; bfloat16 or float32 can be imported")
    if not bool(torch.isfinite(hidden).all()):
        bad = int((~torch.isfinite(hidden)).sum())
        raise ValueError(f"hidden states hold {bad} NaN/Inf value(s)")
    if mask is None:
        mask = torch.ones(n, dtype=torch.int8)
    mask = mask.reshape(-1)
    if mask.shape[0] != n:
        raise ValueError(f"loss mask has {mask.shape[0]} entries for {n} input ids")
    return ids.to(torch.int64), mask.to(torch.int8), hidden.contiguous()


def _storage(hidden) -> np.ndarray:
    import torch

    if hidden.dtype == torch.bfloat16:
        return hidden.view(torch.int16).numpy().view(np.uint16)
    return hidden.numpy()


def import_dir(fmt: str, root: str | Path, opts: EvalOptions, store, *, layers: list[int],
               progress=None, check: bool = True, log=None) -> ImportResult:
    """Import the samples under ``root``; see the module docstring. Raises BadInputError (exit 6)
    after committing the good samples when any were refused, and before writing anything when the
    declared layers do not hold on a recomputed sample (``check``; ``log``: its progress line)."""
    from ..models.resolve import resolved_target
    from ..models.target import FINAL, check_layer_ids, read_model_info, resolve_kernel
    from ..stages import hidden_states as hs_stage
    from ..stages import tokens as tokens_stage

    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}.")
    root = Path(root)
    if not root.is_dir():
        raise BadInputError(f"{root} is not a directory; give the directory the {fmt} files are in.")
    if not layers:
        raise UsageError("declare the layer ids the files hold, in file order: --layer K (repeatable; "
                         "dfcache numbering, the output of decoder layer k).")
    if opts.backend == "auto" or opts.device == "auto":
        raise UsageError("declare the backend class that made the states: --backend fla|torch and "
                         "--device cuda|cpu (they are key material, never guessed for imports).")
    ctx = RunContext(store, opts, argv=["import"])
    target = resolved_target(ctx)
    info = read_model_info(target.dir)
    check_layer_ids(list(layers), info.num_layers)
    if len(set(layers)) != len(layers):
        raise UsageError(f"--layer {layers}: each layer once, in the order the files hold them.")
    files = _files(fmt, root)
    if not files:
        raise BadInputError(f"no {fmt} sample files under {root} (looked for "
                            f"{ {'specforge': 'rows_*/data_*.ckpt', 'speculators': 'hidden_states/hs_*.safetensors', 'modelopt': '*.pt'}[fmt] }).")
    masks = _prepared_masks(root) if fmt == "speculators" else None
    notes = []
    if _carries_final(fmt, files[0]):
        layers = [k for k in layers if k != FINAL] + [FINAL]
        notes.append("the files carry the target's final state (after its final norm): imported as layer 'final'.")
    if fmt == "speculators" and masks is None:
        notes.append("no prepared dataset beside the files: every token counts in loss_mask.")
    if fmt == "modelopt":
        notes.append("ModelOpt files carry no loss mask: every token counts in loss_mask.")
    n_layers, width = len(layers), info.hidden_size

    # Pass 1: every file read whole and checked; ids and masks kept (small), states dropped.
    good: list[tuple[Path, np.ndarray, np.ndarray]] = []
    refused: list[Refused] = []
    dtype = None
    bar = progress(len(files), "check") if progress else None
    for path in files:
        rel = path.relative_to(root).as_posix()
        try:
            ids, mask, hidden = _check(fmt, *_read(fmt, path, masks), n_layers, width, info.vocab_size)
            dt = "bfloat16" if str(hidden.dtype) == "torch.bfloat16" else "float32"
            if dtype not in (None, dt):
                raise ValueError(f"hidden states are {dt}, the samples before it {dtype}")
            dtype = dt
            good.append((path, ids.numpy(), mask.numpy()))
        except Exception as e:  # a broken file of any kind is that file's refusal, not the import's
            refused.append(Refused(rel, _reason(e)))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    result = ImportResult(format=fmt, samples=len(good), refused=refused, tokens_key=None, layer_keys={},
                          notes=notes, provenance=CHECKED if check else UNCHECKED,
                          layer_check=None if check else {"checked": False, "reason": "--no-check"})
    if good:
        backend = resolve_kernel(opts.backend, opts.device, dtype, opts.attn_implementation,
                                  has_linear_attention=info.has_linear_attention, check=False)
        if check:
            result.layer_check = _check_layers(fmt, root, good, masks, list(layers), width, info, target, backend,
                                               log).to_dict()
        _commit(fmt, root, good, layers, width, backend, target, store, result, masks, progress,
                tokens_stage, hs_stage)
    if refused:
        lines = [f"refused {len(refused)} of {len(files)} {fmt} sample(s) under {root}"
                 + (f" ({len(good)} imported)" if good else " (nothing imported)") + ":"]
        lines += [f"  - {r.file}: {r.reason}" for r in refused[:50]]
        if len(refused) > 50:
            lines.append(f"  ... {len(refused) - 50} more")
        lines.append("Regenerate those samples with the tool that made them, then import the directory again.")
        err = BadInputError("\n".join(lines))
        err.result = result  # the CLI prints what was imported before the error
        raise err
    return result


def _check_layers(fmt, root: Path, good, masks, layers: list[int], width: int, info, target, declared, log):
    """Recompute the shortest good sample's first tokens and check each column's layer (see
    runner/peers/import_check.py); raises the refusal (exit 6) before anything is written."""
    from .import_check import (CHECK_TOKENS, TOLERANCE_CROSS, TOLERANCE_SAME, LayerCheck, candidates, check_columns,
                               recompute, refusal)
    from ..models.resolve import require_weights
    from ..models.target import KernelSpec

    i = min(range(len(good)), key=lambda j: (len(good[j][1]), j))
    path, ids, _ = good[i]
    n = min(len(ids), CHECK_TOKENS)
    # The CPU and torch's kernels run anywhere the model fits in memory; the declared class itself
    # when it is a CPU one (then the rows must agree to its rounding), else the same dtype with
    # sdpa attention (flash-attention runs only on GPUs).
    on_cpu = declared.device == "cpu"
    spec = KernelSpec("torch", "cpu", declared.dtype, declared.attn_implementation if on_cpu else "sdpa")
    same = on_cpu and spec.to_key() == declared.to_key()
    rel = path.relative_to(root).as_posix()
    require_weights(target.dir, "the import checks the declared layers on a recomputed sample: pass the "
                                "directory that holds the target's weights with --target, or --no-check to import "
                                "them as declared (marked unchecked).")
    if log:
        log(f"checking the declared layers {layers}: recomputing {rel} ({n} tokens) with the target on the CPU "
            f"({spec.label})")
    _, _, hidden = _check(fmt, *_read(fmt, path, masks), len(layers), width, None)
    rows = hidden[:n].float().numpy()
    cands = candidates(layers, info.num_layers)
    fresh = recompute(target.dir, spec, ids[:n], cands)
    res = LayerCheck(sample=rel, tokens=n, recomputed_with=spec.label, same_class=same,
                     tolerance=TOLERANCE_SAME[declared.dtype] if same else TOLERANCE_CROSS)
    res.columns = check_columns(rows, layers, fresh, [c for c in cands if c.name in fresh],
                                res.tolerance)
    if not res.ok:
        raise refusal(res, cands, fmt, root)
    return res


def _reason(e: Exception) -> str:
    if isinstance(e, ValueError):
        return str(e)
    text = str(e).splitlines()[0] if str(e) else ""
    return f"unreadable (truncated or corrupt): {type(e).__name__}{': ' + text[:160] if text else ''}"


IMPORT_STAGE = "import"  # the set-level artifact naming an imported set's samples, in file order
IMPORT_VERSION = 1
SET_DOC = "set"
_SINK_BYTES = 64 << 20  # per layer: what a layer's sink buffers before committing a segment


def tokens_partition(target, fmt_free: bool = True):
    """Imported tokens samples: a root partition (no completions upstream), keyed by the target's
    tokenizer and marked imported; a sample is identified by the digest of its ids and loss mask,
    so the same sample imported again, from any directory or set, is the same sample."""
    from dfcache.samples import Partition

    from ..stages import tokens as tokens_stage

    inputs = {"target": target.fingerprint, "tokenizer": target.tokenizer_fingerprint,
              "chat_template": target.chat_template_hash, "enable_thinking": False, "imported": PROVENANCE}
    return Partition(tokens_stage.NAME, tokens_stage.VERSION, inputs, {})


def _sample_upstream(ids: np.ndarray, mask: np.ndarray) -> str:
    h = xxhash.xxh3_128()
    h.update(b"ids:")
    h.update(np.ascontiguousarray(ids, dtype="<i4").view(np.uint8).reshape(-1))
    h.update(b"loss_mask:")
    h.update(np.ascontiguousarray(mask, dtype=np.int8).view(np.uint8).reshape(-1))
    return h.hexdigest()


def _commit(fmt, root, good, layers, width, backend, target, store, result, masks, progress,
            tokens_stage, hs_stage) -> None:
    """Samples into the store's per-sample segments (only those not there yet), then the import
    artifact listing the set's samples in file order (the key the user reads them by)."""
    from dfcache.keys import compute_key
    from dfcache.samples import Partition, SampleArray, SampleSink, index_of

    tpart = tokens_partition(target)
    ups = [_sample_upstream(g[1], g[2]) for g in good]
    tkeys = tpart.sample_keys(ups)
    hparts = {k: Partition(hs_stage.NAME, hs_stage.VERSION,
                           {"target": target.fingerprint, "layer": k, "backend": backend.to_key()},
                           {"sample": tpart.key}) for k in layers}
    hkeys = {k: hparts[k].sample_keys(tkeys) for k in layers}
    idx = index_of(store)
    have_t = set(tkeys) - set(idx.missing(tpart.key, tkeys))
    have_h = {k: set(hkeys[k]) - set(idx.missing(hparts[k].key, hkeys[k])) for k in layers}
    provenance = {"imported": result.provenance, "format": fmt, "source": str(root.resolve()), "files": len(good),
                  "target_dir": str(target.dir),  # what `verify --recompute` loads by default
                  "layer_check": result.layer_check}
    set_doc = {"format": fmt, "tokens_partition": tpart.key, "tokens": tkeys,
               "ids": [f"{fmt}:{g[0].relative_to(root).as_posix()}" for g in good],
               "layers": list(layers), "layer_partitions": [hparts[k].key for k in layers],
               "hidden_states": [hkeys[k] for k in layers]}
    from dfcache.keys import canonical_encode

    set_inputs = {"format": fmt, "samples": len(good), "layers": list(layers), "tokens_partition": tpart.key,
                  "layer_partitions": set_doc["layer_partitions"],
                  "set": xxhash.xxh3_128_hexdigest(canonical_encode(set_doc))}
    if result.provenance == UNCHECKED:
        # An unchecked import of a set is its own artifact, marked so: a checked import of the same
        # files (the key it had before checks existed) never finds it and says "already imported".
        set_inputs["unchecked"] = True
    key = compute_key(IMPORT_STAGE, IMPORT_VERSION, set_inputs)
    result.tokens_key = key
    result.layer_keys = {k: hparts[k].key for k in layers}
    result.reused = sum(1 for k in tkeys if k in have_t)
    todo = [i for i in range(len(good)) if tkeys[i] not in have_t
            or any(hkeys[k][i] not in have_h[k] for k in layers)]
    if not todo and store.has(key):
        result.already = True
        return
    dtype = backend.dtype
    summary = f"{result.provenance} from {fmt}"
    sinks = {"tokens": SampleSink(store, tpart, arrays={"ids": SampleArray((), "int32"),
                                                        "loss_mask": SampleArray((), "int8")},
                                  summary=summary, provenance=provenance)}
    for k in layers:
        sinks[k] = SampleSink(store, hparts[k], arrays={"hidden": SampleArray((width,), dtype)}, doc=False,
                              summary=f"{summary}: layer {k}", max_bytes=_SINK_BYTES,
                              provenance={**provenance, "declared_backend": backend.to_key()})
    import contextlib

    bar = progress(len(todo), "import") if progress and todo else None
    added: set = set()
    # Leaving the stack commits what every sink holds, also when interrupted (a finished sample is
    # complete): a rerun imports only the rest.
    with contextlib.ExitStack() as stack:
        for sink in sinks.values():
            stack.enter_context(sink)
        for i in todo:
            path, ids, mask = good[i]
            if tkeys[i] in added:  # the same sample twice in the set
                continue
            added.add(tkeys[i])
            if tkeys[i] not in have_t:
                p = int(np.argmax(mask != 0)) if mask.any() else len(mask)
                sinks["tokens"].add(ups[i], {"ids": ids.astype(np.int32), "loss_mask": mask.astype(np.int8)},
                                    {"id": set_doc["ids"][i], "finish_reason": None,
                                     "tokens_source": f"imported from {fmt}", "eos_appended": False,
                                     "prompt_len": p, "completion_len": len(ids) - p})
            want = [j for j, k in enumerate(layers) if hkeys[k][i] not in have_h[k]]
            if want:
                _, _, hidden = _check(fmt, *_read(fmt, path, masks), len(layers), width, None)
                rows = _storage(hidden)
                for j in want:
                    sinks[layers[j]].add(tkeys[i], {"hidden": rows[:, j * width:(j + 1) * width]})
            if bar is not None:
                bar.update(1)
    if bar is not None:
        bar.close()
    # The set is read by its samples, so name them: gc then refuses to remove a segment it needs.
    refs = [{"partition": tpart.key, "keys": list(dict.fromkeys(tkeys))}] + \
        [{"partition": hparts[k].key, "keys": list(dict.fromkeys(hkeys[k]))} for k in layers]
    with store.writer(key, stage=IMPORT_STAGE, stage_version=IMPORT_VERSION, inputs=set_inputs,
            provenance={**provenance, "declared_backend": backend.to_key()},
            summary=f"{summary}: {len(good)} samples, layers {list(layers)}", sample_refs=refs) as w:
        w.put_json(SET_DOC, set_doc)


def read_import(store, key: str) -> dict:
    """The set document of an import artifact (see :func:`_commit`)."""
    return store.open(key).json(SET_DOC)
