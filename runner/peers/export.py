"""`dfcache export`: a selection's stored states in SpecForge's or speculators' on-disk layout.

Layouts (read from the peers' own code; docs/cli.md, "Training data: export to SpecForge and
speculators", has the sources):

* ``specforge`` (SpecForge ``scripts/prepare_hidden_states.py`` with the DFlash capture layout,
  read by ``specforge.runtime.data_plane.feature_store.load_feature_file`` and normalized by
  ``specforge.algorithms.common.dflash_family_data.normalize_offline_sample``): one
  ``torch.save`` file per sample, ``rows_{g}-{g+2000}/data_{i}.ckpt`` with ``g = i // 2000 * 2000``,
  holding ``{"input_ids": int64 [n], "loss_mask": int64 [n], "hidden_states": bf16
  [1, n, len(layers) * hidden]}``, layers concatenated in the drafter's ``target_layer_ids`` order.
* ``speculators`` (vLLM's hidden-states connector output as speculators 0.9 reads it through
  ``hs_connectors.FileTransfer`` and ``speculators.train.data.ArrowDataset``):
  ``hidden_states/hs_{i}.safetensors`` holding ``hidden_states`` bf16 ``[n, len(layers), hidden]``
  and ``token_ids`` int64 ``[n]``, where the layers are the drafter's layers without the target's
  last layer, then the last layer (speculators splits it off as ``verifier_last_hidden_states``);
  beside it the prepared dataset speculators trains from (``datasets.save_to_disk``: columns
  ``input_ids``, ``loss_mask``, ``seq_len``, torch format), since its loss mask lives there. Its
  layer ids are dfcache's plus one (``aux_hidden_state_layer_ids``), recorded in the manifest.
  FP8 states (``--compression fp8-e4m3``) go out in speculators' FP8 layout (hs-connectors'
  ``FP8HiddenStatesConnector``, read by its ``FP8Transfer``): ``hidden_states`` float8_e4m3fn
  ``[n, len(layers), hidden]`` and ``hidden_states_scales`` float32, as stored (no requantization):
  ``[n, len(layers), 1]``, one scale per token and layer, where their writer makes one per token
  (``[n, 1, 1]``); their reader's ``fp8.to(bf16) * scale.to(bf16)`` broadcasts either, and gives
  dfcache's bf16 bit for bit. SpecForge has no FP8 layout: it gets them dequantized to bf16.

EAGLE-3 (the selection's first ``--drafter`` is an EAGLE-3 checkpoint): what it trains on is its
three layers (its ``fc`` input, in its order) and the target's final state (the teacher's logits).

* ``speculators`` (``speculators.models.eagle3``): the layout above with the three layers kept as
  they are (none dropped, even the target's last) and the target's last layer after them:
  ``hidden_states`` ``[n, 4, hidden]``; ``ArrowDataset`` gives ``hidden_states`` ``[n, 3 x hidden]``
  and ``verifier_last_hidden_states``, to which speculators' EAGLE-3 applies the target's norm itself
  (``verifier_norm``), so the stored last layer (before the final norm) is what it wants.
* ``specforge``: SpecForge's offline EAGLE-3 files (read by
  ``specforge.runtime.data_plane.offline_reader.OfflineManifestReader`` with its
  ``_OFFLINE_EAGLE3_KEYS`` and normalized by ``specforge.algorithms.eagle3.data.normalize_offline_sample``),
  same paths as above, holding ``{"input_ids": int64 [n], "loss_mask": int64 [n],
  "aux_hidden_state": [1, n, 3 x hidden] (the three layers concatenated in the drafter's order),
  "hidden_state": [1, n, hidden]}``: the target's state *after* its final norm (SGLang's
  ``last_hidden_states``, the logits processor's input; SpecForge's target head is the bare
  ``lm_head``). That is the hidden-state layer ``"final"`` (runner/stages/hidden_states): the
  selection asks for it, and a store without it is exit 3 naming ``run hidden-states ... --final-state``.

DSpark (``runner.drafters.family.DSpark``; or any selection with ``--final-state``) in ``specforge``:
SpecForge's DSpark trainer reads ``target_last_hidden_states`` beside the DFlash layout
(``specforge.algorithms.common.dflash_family_data.normalize_dspark_offline_sample``, required by
``build_dspark_offline_reader``; its lm_head gives the teacher logits of the L1 and confidence losses,
so it is the state after the final norm too): the files are the DFlash layout above plus
``"target_last_hidden_states": [1, n, hidden]``, the layer ``"final"``. speculators' layouts have no
final state (its EAGLE-3 normalizes the stored last layer itself), so ``--final-state`` with
``--format speculators`` is refused (exit 6).

Every file is written to a temporary name in its directory and renamed into place, so a file
that exists is complete; ``dfcache-export.json`` (the selection, the files, ``complete``) is
written first and marked complete last. An interrupted export resumes: files present are kept.
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import numpy as np

from dfcache.errors import BadInputError, UsageError

from ..core.samples import Selection

FORMATS = ("specforge", "speculators")
MANIFEST = "dfcache-export.json"
EXPORT_VERSION = 1
SPECFORGE_GROUP = 2000  # SpecForge's --file-group-size default
SCALES_KEY = "hidden_states_scales"  # hs_connectors.fp8_utils.SCALES_KEY: the scales of FP8 hidden_states
_UMASK = os.umask(0o022)
os.umask(_UMASK)


def specforge_relpath(i: int) -> str:
    g = (i // SPECFORGE_GROUP) * SPECFORGE_GROUP
    return f"rows_{g}-{g + SPECFORGE_GROUP}/data_{i}.ckpt"


def speculators_relpath(i: int) -> str:
    return f"hidden_states/hs_{i}.safetensors"


@dataclass
class ExportResult:
    format: str
    out: Path
    samples: int
    written: int
    skipped: int
    bytes_written: int
    layers: list[int]
    files: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_dict(self) -> dict:
        return {"format": self.format, "out": str(self.out), "samples": self.samples, "written": self.written,
                "skipped": self.skipped, "bytes_written": self.bytes_written, "layers": self.layers,
                "notes": self.notes}


def _identity(fmt: str, sel: Selection) -> dict:
    return {"format": fmt, "export_version": EXPORT_VERSION, **sel.identity()}


def _read_manifest(out: Path) -> dict | None:
    try:
        return json.loads((out / MANIFEST).read_text())
    except (OSError, ValueError):
        return None


def _atomic_write(path: Path, write: Callable[[Path], None]) -> int:
    path.parent.mkdir(parents=True, exist_ok=True)
    # The temporary name ends neither in .ckpt nor .safetensors: the peers' directory scans skip it.
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.partial")
    try:
        write(tmp)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)  # as a plain open() would (safetensors writes 0600)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return path.stat().st_size


def _write_json(path: Path, doc: dict) -> None:
    _atomic_write(path, lambda p: p.write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n"))


def check_destination(fmt: str, sel: Selection, out: Path) -> dict | None:
    """The previous export's manifest if ``out`` holds one of this selection; raises if ``out``
    holds anything else. None: ``out`` is empty or absent."""
    if not out.exists():
        return None
    if not out.is_dir():
        raise UsageError(f"--out {out} is a file; give a directory (new, empty, or a previous export of "
                         "this selection).")
    if not any(out.iterdir()):
        return None
    man = _read_manifest(out)
    if man is None:
        raise UsageError(f"--out {out} is not empty and is not a dfcache export; give a new or empty "
                         "directory (or delete that one).")
    if man.get("identity") != _identity(fmt, sel):
        raise UsageError(f"--out {out} holds an export of another selection ({man.get('identity', {}).get('format')}"
                         f", tokens {str(man.get('identity', {}).get('tokens'))[:12]}); give a new or empty "
                         "directory, or delete that one to replace it.")
    return man


def refuse_final_state_in_speculators() -> None:
    raise BadInputError("--final-state with --format speculators: speculators' layouts hold no state after "
                        "the target's final norm (its EAGLE-3 applies verifier_norm to the stored last layer "
                        "itself); drop --final-state, or export with --format specforge.")


def export(sel: Selection, fmt: str, out: str | os.PathLike, *, progress=None) -> ExportResult:
    """Write the selection's samples in ``fmt``'s layout under ``out`` (resuming a previous try)."""
    if fmt not in FORMATS:
        raise UsageError(f"--format {fmt!r} is not one of {', '.join(FORMATS)}.")
    out = Path(out)
    if fmt == "speculators":
        try:
            import datasets  # noqa: F401
        except ImportError:
            # A well-formed command this install cannot carry out: bad input (6), like a model it
            # cannot load, not a malformed command line (2).
            raise BadInputError("--format speculators also writes the prepared dataset speculators trains "
                                "from, with the `datasets` package, which is not installed; install it with "
                                "pip install 'dfcache[peers]' (or pip install datasets).") from None
    from ..models.target import FINAL

    final = FINAL in sel.layers
    if fmt == "speculators" and final:
        refuse_final_state_in_speculators()
    if fmt == "specforge" and getattr(sel, "drafter_family", None) == "eagle3" and not final:
        raise BadInputError("--format specforge for an EAGLE-3 drafter needs the target's final state "
                            "('hidden_state'), which this selection lacks; pass --drafter with the EAGLE-3 "
                            "checkpoint (the selection then adds it).")
    check_destination(fmt, sel, out)
    src = sel.source()
    keys = src.keys()
    rel = specforge_relpath if fmt == "specforge" else speculators_relpath
    manifest = {"identity": _identity(fmt, sel), "complete": False, "samples": len(src),
                "layers": sel.layers, "hidden_size": sel.hidden_size, "num_layers": sel.num_layers,
                "backend": sel.backend, "dtype": src.dtype,
                "provenance": "exported by dfcache from the artifacts named in identity",
                "files": [{"file": rel(i), "key": keys[i]} for i in range(len(src))]}
    if getattr(sel, "drafter_family", None):
        manifest["drafter_family"] = sel.drafter_family
    if fmt == "specforge" and final:
        eagle = getattr(sel, "drafter_family", None) == "eagle3"
        manifest["specforge_layout"] = "eagle3" if eagle else "dspark"
        manifest["note"] = (("aux_hidden_state" if eagle else "hidden_states") + " holds the layers listed in "
                            "'layers' but 'final' (dfcache ids: output of decoder layer k), concatenated; "
                            + ("hidden_state" if eagle else "target_last_hidden_states") + " is layer 'final', "
                            "the target's state after its final norm (what its lm_head reads).")
    if fmt == "speculators":
        manifest["aux_hidden_state_layer_ids"] = [k + 1 for k in sel.layers[:-1]]
        manifest["note"] = ("hidden_states holds the layers listed in 'layers' (dfcache ids: output of decoder "
                            "layer k); speculators ids are k+1; the last one is the target's last layer.")
    out.mkdir(parents=True, exist_ok=True)
    _write_json(out / MANIFEST, manifest)
    res = ExportResult(format=fmt, out=out, samples=len(src), written=0, skipped=0, bytes_written=0,
                       layers=list(sel.layers))
    bar = progress(len(src)) if progress else None
    for i in range(len(src)):
        path = out / rel(i)
        if path.exists():
            res.skipped += 1
        else:
            res.bytes_written += _atomic_write(path, lambda p, i=i: _write_sample(fmt, src, i, p, sel))
            res.written += 1
            res.files.append(rel(i))
        if bar is not None:
            bar.update(1)
    if bar is not None:
        bar.close()
    if fmt == "speculators":
        res.bytes_written += _write_prepared_dataset(src, out)
    if getattr(src, "fp8", False):
        res.notes.append("the states are FP8 (fp8-e4m3) as stored: " + (
            "hidden_states are float8_e4m3fn with hidden_states_scales [n, layers, 1] (one per token and layer), "
            "which speculators' FP8 reader (hs_connectors.FP8Transfer) dequantizes" if fmt == "speculators" else
            "SpecForge has no FP8 layout, so they are written dequantized to bfloat16"))
    elif src.dtype != "bfloat16":
        res.notes.append(f"the states are {src.dtype} as stored (extracted with --dtype {src.dtype}); the peers "
                         "train from bfloat16.")
    manifest["complete"] = True
    _write_json(out / MANIFEST, manifest)
    return res


def _write_sample(fmt: str, src, i: int, path: Path, sel=None) -> None:
    import torch

    from dfcache.fp8 import dequantize_codes
    from dfcache.training import to_torch

    from ..models.target import FINAL

    s = src.read(i)
    ids = torch.from_numpy(s.arrays["input_ids"])
    fp8 = getattr(src, "fp8", False)
    if fmt == "specforge" and sel is not None and FINAL in sel.layers:
        # EAGLE-3 / DSpark: the layers concatenated, and the final state (the last layer) apart.
        dtype = "bfloat16" if fp8 else src.dtype  # FP8 layers are read dequantized to bf16
        layers = src.read_layers(i)
        aux = to_torch(np.concatenate(layers[:-1], axis=1), dtype)
        last = to_torch(layers[-1], dtype)
        eagle = getattr(sel, "drafter_family", None) == "eagle3"
        record = {"input_ids": ids, "loss_mask": torch.from_numpy(s.arrays["loss_mask"]),
                  ("aux_hidden_state" if eagle else "hidden_states"): aux.unsqueeze(0),
                  ("hidden_state" if eagle else "target_last_hidden_states"): last.unsqueeze(0)}
        torch.save(record, path)
        return
    if fmt == "specforge":
        hs = to_torch(s.arrays["hidden_states"], src.dtype) if not fp8 else \
            to_torch(dequantize_codes(s.arrays["hidden_states"], s.arrays["hidden_states_scales"]), "bfloat16")
        record = {"input_ids": ids, "loss_mask": torch.from_numpy(s.arrays["loss_mask"]),
                  "hidden_states": hs.unsqueeze(0)}
        torch.save(record, path)
        return
    from safetensors.torch import save_file

    if fp8:  # speculators' FP8 layout: codes [n, layers, hidden], scales [n, layers, 1]
        n, layers = s.arrays["hidden_states_scales"].shape
        codes = to_torch(s.arrays["hidden_states"], "float8_e4m3fn").reshape(n, layers, -1)
        scales = torch.from_numpy(np.ascontiguousarray(s.arrays["hidden_states_scales"])).reshape(n, layers, 1)
        save_file({"hidden_states": codes, SCALES_KEY: scales, "token_ids": ids}, str(path))
        return
    stacked = np.stack(src.read_layers(i), axis=1)  # [n, layers, hidden]
    save_file({"hidden_states": to_torch(stacked, src.dtype), "token_ids": ids}, str(path))


def _write_prepared_dataset(src, out: Path) -> int:
    """speculators' prepared dataset (its loss masks) beside the hidden states, state.json last."""
    if (out / "state.json").exists():
        return 0
    import datasets

    rows = {"input_ids": [], "loss_mask": [], "seq_len": []}
    for i in range(len(src)):
        a, b = int(src.offsets[i]), int(src.offsets[i + 1])
        ids = src.read_tokens(i)
        mask = np.zeros(b - a, dtype=np.int64)
        mask[int(src.prompt_lens[i]):] = 1
        rows["input_ids"].append(ids.tolist())
        rows["loss_mask"].append(mask.tolist())
        rows["seq_len"].append(b - a)
    features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int64")),
                                  "loss_mask": datasets.Sequence(datasets.Value("int64")),
                                  "seq_len": datasets.Value("int64")})
    datasets.disable_progress_bars()
    ds = datasets.Dataset.from_dict(rows, features=features)
    ds.set_format(type="torch")
    tmp = out / f".prepared.{uuid.uuid4().hex[:8]}.partial"
    total = 0
    try:
        ds.save_to_disk(str(tmp))
        names = sorted(p.name for p in tmp.iterdir())
        for name in [n for n in names if n != "state.json"] + ["state.json"]:
            os.replace(tmp / name, out / name)
            total += (out / name).stat().st_size
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return total
