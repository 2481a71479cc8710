"""`gpu-extract`: GPU results, read from ``--gpu-json PATH[,PATH...]`` (written on a GPU host by
``bench/gpu_extract.py`` and ``bench/gpu_eval.py``) and shown in the table; without it, one row
saying the benchmark was not run here. A JSON with ``rows`` (the suite's row format, targets
included) is shown as those rows.

Accepted JSON: what ``bench/gpu_extract.py`` writes (``throughput`` rows ``{what, backend,
tokens, seconds, tok_per_s, vs_bare}``, ``diff`` per layer, ``exactness``, ``errors``): one row per
throughput row (ratio = tokens/s relative to the bare forward on the same batches), one row for the
fla-vs-torch difference (worst layer) and one for exactness (lowest share of bitwise-equal
elements). Also accepted: ``{"rows": [...]}`` in this suite's row format, or any object whose
numeric fields are then shown one row each.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from ._common import Ctx, Result, Row, fmt_num, skipped

NAME = "gpu-extract"
_FIELDS = ("measure", "dfcache", "competitor", "ratio", "unit", "target", "direction", "note")


def _flatten(obj, prefix=""):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _flatten(v, f"{prefix}{k}.")
    elif isinstance(obj, (int, float)) and not isinstance(obj, bool):
        yield prefix[:-1], obj


def run(ctx: Ctx) -> Result:
    if not ctx.gpu_json:
        return Result([skipped(NAME, "hidden-state extraction on a GPU",
                               "not run here (no GPU); run bench/gpu_extract.py on a GPU host and pass "
                               "--gpu-json PATH")])
    rows, raw = [], {}
    for part in str(ctx.gpu_json).split(","):
        path = Path(part.strip())
        try:
            doc = json.loads(path.read_text())
        except (OSError, ValueError) as e:
            rows.append(skipped(NAME, "GPU results", f"SKIPPED: cannot read {path}: {e}"))
            continue
        raw[str(path)] = doc
        source = _source(doc, path)
        for row in _rows_of(doc, path):
            row.source = source
            rows.append(row)
    if not rows:
        rows.append(skipped(NAME, "GPU results", f"SKIPPED: {ctx.gpu_json} holds no results"))
    return Result(rows, {"source": str(ctx.gpu_json), "raw": raw})


def _source(doc, path: Path) -> str:
    """"GPU, date, file" of a GPU result: the card from its ``env``, the date from its ``date`` field
    or, for the files written before it had one, the ``YYYY-MM-DD`` in the file name."""
    env = doc.get("env") if isinstance(doc, dict) and isinstance(doc.get("env"), dict) else {}
    date = doc.get("date") if isinstance(doc, dict) and isinstance(doc.get("date"), str) else None
    if date is None:
        m = re.search(r"(\d{4}-\d{2}-\d{2})", path.name)
        date = m.group(1) if m else "date unknown"
    parts = [str(env.get("gpu") or env.get("device") or "GPU"), date[:10], str(path)]
    return ", ".join(parts)


def _rows_of(doc, path: Path) -> list[Row]:
    rows = []
    if isinstance(doc, dict) and isinstance(doc.get("rows"), list) and doc["rows"]:
        for r in doc["rows"]:
            kw = {k: r[k] for k in _FIELDS if k in r and r[k] is not None}
            kw["measure"] = str(kw.get("measure", "?"))
            for k in ("dfcache", "competitor", "note"):
                kw[k] = str(kw.get(k, ""))
            row = Row(NAME, **kw)
            if r.get("status") in ("SKIPPED", "ERROR") or (r.get("status") == "FAIL" and r.get("ratio") is None):
                row.status = r["status"]  # a FAIL without a ratio: the row could not use its intended data
            rows.append(row.judge())
    elif isinstance(doc, dict) and isinstance(doc.get("throughput"), list):
        rows = _from_gpu_extract(doc, path)
    else:
        for k, v in _flatten(doc):
            rows.append(Row(NAME, k, fmt_num(float(v)), note=f"from {path.name}"))
    return rows


def _from_gpu_extract(doc: dict, path: Path) -> list[Row]:
    env = doc.get("env") or {}
    gpu = env.get("gpu") or env.get("device") or ""
    where = f"{gpu}; " if gpu else ""
    rows = []
    for r in doc["throughput"]:
        tps = r.get("tok_per_s")
        rows.append(Row(NAME, f"{r.get('what', '?')} [{r.get('backend', '')}]",
                        f"{tps:,.0f} tok/s" if tps else "", f"{r.get('tokens', '')} tokens in {r.get('seconds', '')} s",
                        r.get("vs_bare"), unit="x", note=f"{where}ratio = tokens/s / bare forward to the deepest layer"))
    diff = doc.get("diff") or {}
    if diff:
        worst = max(diff.items(), key=lambda kv: kv[1].get("rel_l2", 0))
        d = worst[1]
        rows.append(Row(NAME, "fla vs torch hidden states, worst layer (rel L2)", f"{d.get('rel_l2', 0):.4g}",
                        f"layer {worst[0]}", None,
                        note=f"cos min {d.get('cos_min')}, max|d| {d.get('max_abs')}, equal {d.get('equal')}"))
    ex = doc.get("exactness") or {}
    for kernel, per in ex.items():
        if per:
            low = min(min(v.values()) for v in per.values())
            rows.append(Row(NAME, f"stored rows bitwise-equal to an unbatched forward [{kernel}]", f"{low * 100:.2f} %",
                            "", None, note="lowest share over the checked samples and layers"))
    errs = doc.get("errors") or []
    if errs:
        rows.append(Row(NAME, "GPU phases failed or skipped", str(len(errs)), "", None,
                        note="; ".join(f"{e.get('phase')}: {str(e.get('error'))[:80]}" for e in errs)))
    return rows
