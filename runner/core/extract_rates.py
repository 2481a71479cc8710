"""Extraction rates remembered per target shape, for `dfcache plan --estimate` (runner/core/estimate.py).

The hidden-states stage records, after every extraction, its tokens/s under the target's shape
(attention kinds, width, depth, dtype) and the device (the GPU's name, or cpu), in
``<store>/extract-rates/rates.json`` beside the store's artifacts; the estimate reads the last one.
A plain JSON file written whole (temporary file + rename): a lost or damaged one costs the
estimate its figure, never a run. No runner imports: the stage and the estimate both use it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

RATES_DIR = "extract-rates"
RATES_FILE = "rates.json"


def shape_key(info, dtype: str) -> str:
    """Targets of one shape: the same attention kinds, width, depth and dtype (the model type is
    left out: a released Qwen3.6 checkpoint says qwen3_5, its text model qwen3_5_text)."""
    kind = "hybrid" if info.has_linear_attention else "dense"
    return f"{kind}/h{info.hidden_size}/l{info.num_layers}/{dtype}"


def _rates_path(store) -> Path | None:
    d = store.local_dir(RATES_DIR)
    return None if d is None else Path(d) / RATES_FILE


def read_rates(store) -> dict:
    path = _rates_path(store)
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}  # a damaged figure file costs the estimate its figure, never the run
    return data if isinstance(data, dict) else {}


def record_rate(store, info, dtype: str, device: str, layers, tokens: int, seconds: float) -> None:
    """Remember an extraction's rate for later estimates (best effort: never fails a run)."""
    if tokens <= 0 or seconds <= 0:
        return
    path = _rates_path(store)
    if path is None:
        return
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        rates = read_rates(store)
        key = shape_key(info, dtype)
        rates.setdefault(key, {})[device] = {"tok_per_s": tokens / seconds, "tokens": int(tokens),
                                             "seconds": round(seconds, 3), "deepest": max(layers),
                                             "layers": sorted(layers), "date": time.strftime("%Y-%m-%d %H:%M")}
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(rates, indent=1, sort_keys=True))
        os.replace(tmp, path)
    except OSError:
        pass
