"""Provenance queries over manifests: ``dfcache ls --where 'fla<0.7' --where 'gpu~H100'``.

A condition is ``FIELD OP VALUE``. OP is one of ``<`` ``<=`` ``>`` ``>=`` (version order, e.g.
``0.10 > 0.9``; plain numbers and strings otherwise), ``==`` / ``=`` / ``!=`` (equal as versions
when both sides parse as versions, so ``0.6 == 0.6.0``; else as strings), ``~`` / ``!~``
(case-insensitive substring). Several conditions all have to hold.

FIELD is looked up, first hit wins, in:

1. a dotted path into the manifest (``provenance.versions.torch``, ``inputs.layer``, ``stage``);
2. the recorded library versions, ``provenance.versions`` (and versions keyed with
   ``--key-versions``, ``inputs.versions``), by distribution name or short alias (``fla`` is
   flash-linear-attention, else fla-core);
3. top-level provenance fields (``gpu``, ``torch_cuda`` alias ``cuda``, ``device``, ``torch``);
4. the backend class (``kernel``, ``device``, ``dtype``, ``attn_implementation`` alias ``attn``);
5. the inputs.

An artifact that does not record FIELD never matches, whatever the operator: ``fla<0.7`` does
not select artifacts made without any fla version recorded. The query reads manifests only.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Iterable

from .errors import UsageError

_OPS = ("<=", ">=", "==", "!=", "!~", "<", ">", "=", "~")
_FIELD = re.compile(r"^[A-Za-z_][A-Za-z0-9_.\-]*$")
ALIASES = {"fla": ("flash-linear-attention", "fla-core"), "cuda": ("torch_cuda", "cuda"),
           "attn": ("attn_implementation",), "causal_conv1d": ("causal-conv1d",)}
_MISSING = object()


@dataclass(frozen=True)
class Condition:
    field: str
    op: str
    value: str

    def __str__(self) -> str:
        return f"{self.field}{self.op}{self.value}"


def parse_where(expr: str) -> Condition:
    """``'fla<0.7'`` -> Condition('fla', '<', '0.7'); a malformed one is a usage error."""
    text = expr.strip()
    best = None
    for op in _OPS:
        i = text.find(op)
        if i > 0 and (best is None or i < best[0] or (i == best[0] and len(op) > len(best[1]))):
            best = (i, op)
    if best is None:
        raise UsageError(f"--where {expr!r}: expected FIELD OP VALUE with OP one of {' '.join(_OPS)} "
                         "(e.g. --where 'fla<0.7' --where 'gpu~H100').")
    i, op = best
    field, value = text[:i].strip(), text[i + len(op):].strip()
    if not _FIELD.match(field) or not value:
        raise UsageError(f"--where {expr!r}: expected FIELD OP VALUE, e.g. 'transformers>=5.0' or 'gpu~H100'.")
    return Condition(field, "==" if op == "=" else op, value)


def _dotted(d: Any, path: str) -> Any:
    cur = d
    for part in path.split("."):
        if isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            return _MISSING
    return cur


def lookup(manifest, field: str) -> Any:
    """The value ``field`` names in a manifest, or the module's ``_MISSING`` sentinel."""
    d = manifest.to_dict() if hasattr(manifest, "to_dict") else dict(manifest)
    v = _dotted(d, field)
    if v is not _MISSING:
        return v
    prov = d.get("provenance") or {}
    inputs = d.get("inputs") or {}
    names = (field,) + ALIASES.get(field, ())
    for versions in (prov.get("versions"), inputs.get("versions")):
        if isinstance(versions, dict):
            for n in names:
                if versions.get(n) is not None:
                    return versions[n]
    backend = inputs.get("backend") if isinstance(inputs.get("backend"), dict) else {}
    for where in (prov, backend, inputs):
        for n in names:
            if n in where and where[n] is not None:
                return where[n]
    return _MISSING


def _version(s: str):
    try:
        from packaging.version import InvalidVersion, Version
    except ImportError:  # packaging is nearly always there (pip needs it); digits are a fallback
        m = re.match(r"^v?(\d+(?:\.\d+)*)", s)
        return tuple(int(x) for x in m.group(1).split(".")) if m else None
    try:
        return Version(s)
    except InvalidVersion:
        return None


def _num(s: str):
    try:
        return float(s)
    except ValueError:
        return None


def matches(manifest, cond: Condition) -> bool:
    v = lookup(manifest, cond.field)
    if v is _MISSING or isinstance(v, (dict, list)):
        return False
    have = str(v).lower() if isinstance(v, bool) else str(v)
    want = cond.value
    if cond.op in ("~", "!~"):
        hit = want.lower() in have.lower()
        return hit if cond.op == "~" else not hit
    a, b = _version(have), _version(want)
    if a is None or b is None:
        a, b = _num(have), _num(want)
    if a is None or b is None:
        a, b = have, want
    if cond.op == "==":
        return a == b
    if cond.op == "!=":
        return a != b
    try:
        return {"<": a < b, "<=": a <= b, ">": a > b, ">=": a >= b}[cond.op]
    except TypeError:
        return False


def filter_manifests(manifests: Iterable, where: Iterable[str] | None) -> list:
    """The manifests for which every ``--where`` condition holds."""
    conds = [parse_where(w) for w in (where or [])]
    return [m for m in manifests if all(matches(m, c) for c in conds)]
