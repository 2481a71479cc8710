"""Numeric comparison of the arrays of two artifacts (`dfcache diff`).

Generic: it compares same-named arrays row by row and knows nothing about what the rows mean.
Per array it reports, with A as the reference:

* ``rel_l2``: ||A - B||_2 / ||A||_2 over all elements (null when A is all zeros and B differs);
* ``max_abs``: max |A - B|;
* ``cos_mean`` / ``cos_min``: cosine similarity of each row of A with the same row of B (rows are
  first-axis slices; a 1-D array is one row), mean and minimum over rows; two zero rows count as
  1, a zero row against a non-zero one as 0;
* ``equal``: share of equal elements. Same dtypes compare storage bits (so -0.0 != 0.0 and equal
  NaNs count as equal); different dtypes (e.g. float32 against bfloat16) compare values exactly
  after widening, reported as ``equal_kind: "values"``.

Everything is computed in row chunks of bounded size (float64 accumulators), so arrays larger
than memory diff fine. Two artifacts are comparable only over the same rows: when both were made
from an upstream artifact in one of :data:`ROW_ROLES` (the role that defines what the rows are),
those upstream keys must agree; otherwise shapes must. Anything else is a
:class:`~dfcache.errors.BadInputError` (exit 6).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

import numpy as np

from .errors import BadInputError

# Upstream roles whose artifact defines an artifact's rows: the same rows need the same key.
ROW_ROLES = ("tokens",)
CHUNK_BYTES = 32 << 20  # float64 bytes of one side per step


@dataclass
class ArrayDiff:
    name: str
    shape: list[int]
    dtype_a: str
    dtype_b: str
    rel_l2: float | None
    max_abs: float
    cos_mean: float
    cos_min: float
    equal: float  # share of equal elements, 0..1
    equal_kind: str  # "bits" | "values"
    rows: int
    nonfinite: int = 0  # elements where either side is NaN or inf (left out of the norms)


@dataclass
class DiffReport:
    key_a: str
    key_b: str
    stage_a: str
    stage_b: str
    inputs_differ: dict = field(default_factory=dict)  # dotted input name -> [value in A, value in B]
    arrays: list[ArrayDiff] = field(default_factory=list)

    def to_dict(self) -> dict:
        d = asdict(self)
        for a in d["arrays"]:
            for k, v in list(a.items()):
                if isinstance(v, float) and not math.isfinite(v):
                    a[k] = None
        return d


def _flatten(d, prefix="") -> dict:
    out = {}
    if isinstance(d, dict):
        for k, v in d.items():
            out.update(_flatten(v, f"{prefix}.{k}" if prefix else str(k)))
    else:
        out[prefix] = d
    return out


def _inputs_differ(a: dict, b: dict) -> dict:
    fa, fb = _flatten(a), _flatten(b)
    return {k: [fa.get(k), fb.get(k)] for k in sorted(set(fa) | set(fb)) if fa.get(k) != fb.get(k)}


def _check_same_rows(ma, mb) -> None:
    for role in ROW_ROLES:
        ka, kb = ma.upstream.get(role), mb.upstream.get(role)
        if ka is not None and kb is not None and ka != kb:
            raise BadInputError(
                f"{ma.key[:12]} and {mb.key[:12]} were made from different {role} artifacts "
                f"({str(ka)[:12]} and {str(kb)[:12]}), so their rows are different data; diff two "
                f"artifacts made from the same {role} (see `dfcache show KEY`).")


def _step_rows(shape: tuple, chunk_a: int, chunk_b: int) -> int:
    row_elems = int(np.prod(shape[1:], dtype=np.int64)) if len(shape) > 1 else 1
    budget = max(1, CHUNK_BYTES // (8 * max(1, row_elems)))
    lcm = chunk_a * chunk_b // math.gcd(chunk_a, chunk_b)
    base = lcm if lcm <= budget else chunk_a  # whole chunks of both sides, when that fits
    return max(base, (budget // base) * base)


def _widen(raw: np.ndarray, dtype: str) -> np.ndarray:
    """Storage rows as float64 (bf16 bits become float32 by a shift, exactly)."""
    if dtype == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32).astype(np.float64)
    return raw.astype(np.float64)


def diff_arrays(ra, rb, name: str) -> ArrayDiff:
    """Compare two :class:`~dfcache.store.ArrayReader` of one shape, chunk by chunk."""
    shape = tuple(ra.shape)
    same_dtype = ra.dtype == rb.dtype
    n = shape[0] if shape else 0
    one_row = len(shape) == 1  # a vector is one row for the cosine
    sq_diff = sq_a = 0.0
    max_abs = 0.0
    equal = 0
    total = 0
    nonfinite = 0
    cos_sum, cos_min, rows = 0.0, math.inf, 0
    dot_acc = na_acc = nb_acc = 0.0
    step = _step_rows(shape, ra.chunk_rows, rb.chunk_rows)
    for start in range(0, n, step):
        stop = min(n, start + step)
        raw_a, raw_b = ra.read_raw(start, stop), rb.read_raw(start, stop)
        if same_dtype:
            equal += int(np.count_nonzero(raw_a == raw_b)) if raw_a.dtype.kind in "iub" else \
                int(np.count_nonzero(raw_a.view(f"u{raw_a.itemsize}") == raw_b.view(f"u{raw_b.itemsize}")))
        a, b = _widen(raw_a, ra.dtype), _widen(raw_b, rb.dtype)
        if not same_dtype:
            equal += int(np.count_nonzero(a == b))
        total += a.size
        fin = np.isfinite(a) & np.isfinite(b)
        if not fin.all():
            nonfinite += int(a.size - np.count_nonzero(fin))
            a = np.where(fin, a, 0.0)
            b = np.where(fin, b, 0.0)
        d = a - b
        sq_diff += float(np.vdot(d, d))
        sq_a += float(np.vdot(a, a))
        if d.size:
            max_abs = max(max_abs, float(np.abs(d).max()))
        if one_row:
            dot_acc += float(a @ b)
            na_acc += float(a @ a)
            nb_acc += float(b @ b)
            continue
        a2, b2 = a.reshape(len(a), -1), b.reshape(len(b), -1)
        dot = np.einsum("ij,ij->i", a2, b2)
        na = np.sqrt(np.einsum("ij,ij->i", a2, a2))
        nb = np.sqrt(np.einsum("ij,ij->i", b2, b2))
        denom = na * nb
        with np.errstate(invalid="ignore", divide="ignore"):
            cos = np.where(denom > 0, dot / np.where(denom > 0, denom, 1.0), np.where((na == 0) & (nb == 0), 1.0, 0.0))
        cos = np.clip(cos, -1.0, 1.0)
        cos_sum += float(cos.sum())
        cos_min = min(cos_min, float(cos.min())) if len(cos) else cos_min
        rows += len(cos)
    if one_row:
        denom = math.sqrt(na_acc) * math.sqrt(nb_acc)
        c = dot_acc / denom if denom > 0 else (1.0 if na_acc == nb_acc == 0 else 0.0)
        cos_sum, cos_min, rows = max(-1.0, min(1.0, c)), max(-1.0, min(1.0, c)), 1
    if sq_a > 0:
        rel = math.sqrt(sq_diff) / math.sqrt(sq_a)
    else:
        rel = 0.0 if sq_diff == 0 else None
    return ArrayDiff(name=name, shape=list(shape), dtype_a=ra.dtype, dtype_b=rb.dtype, rel_l2=rel,
                     max_abs=max_abs, cos_mean=(cos_sum / rows) if rows else 1.0,
                     cos_min=cos_min if rows else 1.0, equal=(equal / total) if total else 1.0,
                     equal_kind="bits" if same_dtype else "values", rows=rows, nonfinite=nonfinite)


class _Dequantized:
    """An FP8 array (dfcache.fp8) as the bf16 rows its readers get: FP8 states diff against bf16 ones."""

    def __init__(self, reader) -> None:
        from .fp8 import hidden_width

        self.reader = reader
        self.shape = (reader.shape[0], hidden_width(reader.shape[1]))
        self.dtype = "bfloat16"
        self.chunk_rows = reader.chunk_rows

    def read_raw(self, start: int, stop: int) -> np.ndarray:
        from .fp8 import dequantize

        return dequantize(self.reader.read_raw(start, stop))


def _logical(reader):
    from .fp8 import FP8_DTYPE

    return _Dequantized(reader) if reader.dtype == FP8_DTYPE else reader


class _SetRows:
    """Samples of one partition laid end to end in the given order (one array's rows), as
    :func:`diff_arrays` walks them; FP8 rows dequantized."""

    def __init__(self, store, partition: str, keys: list[str], name: str) -> None:
        from .samples import SampleSet

        parts = SampleSet(store, partition, keys).read_many(name)
        self._raw = np.concatenate(parts) if parts else np.zeros((0, 0), np.uint16)
        if self._raw.dtype.name == "bfloat16":
            self._raw = self._raw.view(np.uint16)
        self.dtype = "bfloat16" if self._raw.dtype == np.uint16 else str(self._raw.dtype)
        self.shape = self._raw.shape
        self.chunk_rows = max(1, len(self._raw))

    def read_raw(self, start: int, stop: int) -> np.ndarray:
        return self._raw[start:stop]


def diff_sample_sets(store, a: tuple[str, list[str]], b: tuple[str, list[str]], name: str) -> ArrayDiff:
    """Compare array ``name`` of two lists of samples, ``(partition, sample keys)`` each, over the same
    rows (the same upstream samples in the same order): FP8 states against bf16 ones, two backends'."""
    ra, rb = _SetRows(store, *a, name), _SetRows(store, *b, name)
    if tuple(ra.shape) != tuple(rb.shape):
        raise BadInputError(f"array {name} holds {list(ra.shape)} rows in partition {a[0][:12]} but {list(rb.shape)} "
                            f"in {b[0][:12]}: they are not the same samples. Compare samples of the same tokens.")
    return diff_arrays(ra, rb, name)


def diff_artifacts(store, key_a: str, key_b: str, *, arrays: list[str] | None = None) -> DiffReport:
    """Compare the same-named arrays of two committed artifacts (full keys).

    Raises BadInputError when the artifacts are not over the same rows (different row upstream,
    different shapes) or share no array (or lack one named in ``arrays``).
    """
    art_a, art_b = store.open(key_a), store.open(key_b)
    ma, mb = art_a.manifest, art_b.manifest
    _check_same_rows(ma, mb)
    if ma.samples and mb.samples:
        from .samples import Segment

        ua, ub = Segment(store, key_a).upstream, Segment(store, key_b).upstream
        if ua != ub:  # same upstream samples in the same (key) order: the same rows
            raise BadInputError(f"segments {key_a[:12]} and {key_b[:12]} hold different samples ({len(ua)} and "
                                f"{len(ub)}, {len(set(ua) & set(ub))} in common), so their rows are different data; "
                                "diff two segments made from the same samples.")
    names_a, names_b = set(ma.arrays), set(mb.arrays)
    if arrays:
        missing = [(n, k) for n in arrays for k, names in ((key_a, names_a), (key_b, names_b))
                   if n not in names]
        if missing:
            n, k = missing[0]
            raise BadInputError(f"artifact {k[:12]} has no array {n!r} (it has "
                                f"{', '.join(sorted(names_a if k == key_a else names_b)) or 'none'}); pass an "
                                "array both artifacts hold with --array.")
        names = list(dict.fromkeys(arrays))
    else:
        names = sorted(names_a & names_b)
        if not names:
            raise BadInputError(f"artifacts {key_a[:12]} ({ma.stage}) and {key_b[:12]} ({mb.stage}) have no "
                                "array name in common; diff compares arrays of the same name.")
    report = DiffReport(key_a=key_a, key_b=key_b, stage_a=ma.stage, stage_b=mb.stage,
                        inputs_differ=_inputs_differ(ma.inputs, mb.inputs))
    for name in names:
        ra, rb = _logical(art_a.array(name)), _logical(art_b.array(name))
        if tuple(ra.shape) != tuple(rb.shape):
            raise BadInputError(f"array {name} has shape {list(ra.shape)} in {key_a[:12]} but "
                                f"{list(rb.shape)} in {key_b[:12]}: they hold different rows and cannot be "
                                "compared element by element. Diff artifacts made from the same inputs.")
        report.arrays.append(diff_arrays(ra, rb, name))
    return report


def format_report(r: DiffReport) -> str:
    """The human table `dfcache diff` prints."""
    lines = [f"A  {r.key_a}  {r.stage_a}", f"B  {r.key_b}  {r.stage_b}"]
    if r.inputs_differ:
        lines.append("inputs that differ (A | B):")
        for k, (va, vb) in r.inputs_differ.items():
            lines.append(f"  {k}: {va} | {vb}")
    else:
        lines.append("inputs: identical")
    head = ("array", "shape", "dtype A|B", "rel L2", "max |diff|", "cos mean", "cos min", "equal")
    rows = [head]
    for a in r.arrays:
        rel = "n/a (A is 0)" if a.rel_l2 is None else f"{a.rel_l2:.3e}"
        eq = f"{100 * a.equal:.1f}% ({a.equal_kind})"
        rows.append((a.name, "x".join(map(str, a.shape)), f"{a.dtype_a}|{a.dtype_b}", rel,
                     f"{a.max_abs:.3e}", f"{a.cos_mean:.6f}", f"{a.cos_min:.6f}", eq))
    widths = [max(len(str(row[i])) for row in rows) for i in range(len(head))]
    for row in rows:
        lines.append("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    for a in r.arrays:
        if a.nonfinite:
            lines.append(f"note: array {a.name} has {a.nonfinite} non-finite elements (left out of the norms)")
    return "\n".join(lines)
