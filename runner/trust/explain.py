"""`dfcache explain A B`: why two τ differ, from two stored reports (or two rows of one).

Each side is ``KEY`` (a report key or unique prefix: its rows are paired with the other side's by
drafter name) or ``KEY:ROW`` (one row: its 1-based number or its drafter's name). Everything is
read from the two reports (version 6 and later carry their whole selection and, per prompt, the
prompt's record digest and each row's τ; runner/stages/report.py) and from the samples documents
of the store's segments: no model, no torch, nothing recomputed.

What it says:

* the settings that differ, named as the key inputs they are (``completions.enable_thinking``,
  ``hidden_states.backend.kernel``, ``drafter_eval.drafter``), then what differs but is recorded
  only (paths, library versions, the server's address), which changes no key;
* the prompt overlap, by content (a prompt is its messages; ids are names): shared, only in A,
  only in B;
* for the shared prompts, whether completions, tokens and hidden states differ: the sample keys
  of both sides derive from each prompt's record digest and the partitions the reports name
  (dfcache/samples/), and the same key is the same bytes; where keys differ, the per-sample
  digests stored with the segments say whether the bytes still agree;
* per row pair, τ chain on both sides and the per-prompt τ deltas on the shared prompts, largest
  first.

Two reports of different targets are refused (exit 6): their samples share nothing and their τ
are not comparable prompt by prompt.
"""

from __future__ import annotations

from dataclasses import dataclass

from dfcache.errors import BadInputError, UsageError

# Stored as a report's facts but not key material: they can differ between two reports whose
# samples are the same (dotted paths into the report's "selection").
_RECORDED = ("target.path", "target.name", "target.revision", "prompts.source", "completions.server",
             "completions.served_model", "hidden_states.versions", "hidden_states.model_class",
             "hidden_states.gpu", "hidden_states.torch_cuda", "dfcache_version")
_ORDER = ("same_key", "same_bytes", "different", "unknown")  # a prompt's state, best first


@dataclass
class Side:
    spec: str
    key: str
    row: int | None  # index into doc["drafters"], or None for every row
    doc: dict
    prompts: dict

    @property
    def label(self) -> str:
        return self.key[:12] + (f":{self.doc['drafters'][self.row]['drafter']}" if self.row is not None else "")


def load_side(store, spec: str) -> Side:
    """``KEY`` or ``KEY:ROW`` of a stored report; a clear error for anything else."""
    key_part, colon, row_part = spec.partition(":")
    if colon and not row_part:
        raise UsageError(f"{spec!r}: give a row after the colon (its number or its drafter's name), or "
                         "drop the colon to compare every row.")
    full = store.resolve(key_part)  # ArtifactNotFoundError (exit 2) for an unknown key or prefix
    m = store.manifest(full)
    if m.stage != "report":
        raise BadInputError(f"{full[:12]} is a {m.stage} artifact, not a report; explain compares two reports "
                            "(the report_key `dfcache run eval` prints; `dfcache ls --stage report` lists them).")
    art = store.open(full)
    doc = art.json("report")
    if "selection" not in doc or "prompts" not in art.manifest.blobs:
        raise BadInputError(f"report {full[:12]} was made by an older dfcache (report version {m.stage_version}) and "
                            "does not carry its selection; run the `dfcache run eval` that made it again (its "
                            "evals are reused) and explain the new report key it prints.")
    row = None
    if colon:
        names = [d["drafter"] for d in doc["drafters"]]
        if row_part.isdigit() and 1 <= int(row_part) <= len(names):
            row = int(row_part) - 1
        elif row_part in names:
            row = names.index(row_part)
        else:
            rows = ", ".join(f"{i + 1} {n}" for i, n in enumerate(names))
            raise UsageError(f"report {full[:12]} has no row {row_part!r}; its rows are: {rows}. Name one by its "
                             "number or drafter name (KEY:ROW).")
    return Side(spec, full, row, doc, art.json("prompts"))


def _flatten(value, prefix: str) -> dict[str, object]:
    if isinstance(value, dict) and value:
        out: dict[str, object] = {}
        for k in sorted(value):
            out.update(_flatten(value[k], f"{prefix}.{k}"))
        return out
    return {prefix: value}


def _diff(a: dict, b: dict) -> list[dict]:
    return [{"input": k, "a": a.get(k), "b": b.get(k)} for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def _get(doc: dict, path: str):
    for part in path.split("."):
        doc = doc.get(part) if isinstance(doc, dict) else None
    return doc


def _stage_inputs(sel: dict) -> dict[str, object]:
    """The key inputs of the stages before the hidden states, flattened to dotted names
    (``completions.backend.kernel``); hidden states are compared layer by layer apart."""
    stages = sel["stages"]
    out = {}
    for stage in ("prompts", "completions", "tokens"):
        out.update({k: v for k, v in _flatten(stages[stage]["inputs"], stage).items() if v != {}})
    return out


def _hidden_state_diffs(sa: dict, sb: dict) -> list[dict]:
    from ..models.target import layer_of_key, layer_order, sort_layers

    la, lb = sa["stages"]["hidden_states"], sb["stages"]["hidden_states"]
    out = []
    order = lambda k: layer_order(layer_of_key(k))  # noqa: E731  (ids, or "final": after the final norm)
    if sorted(la, key=order) != sorted(lb, key=order):
        out.append({"input": "hidden_states.layers", "a": sort_layers(map(layer_of_key, la)),
                    "b": sort_layers(map(layer_of_key, lb))})
    common = sorted(set(la) & set(lb), key=order)
    per_layer = {k: _diff(_flatten({n: v for n, v in la[k]["inputs"].items() if n != "layer"}, "hidden_states"),
                          _flatten({n: v for n, v in lb[k]["inputs"].items() if n != "layer"}, "hidden_states"))
                 for k in common}
    names = sorted({d["input"] for ds in per_layer.values() for d in ds})
    for name in names:
        hits = {k: next((d for d in ds if d["input"] == name), None) for k, ds in per_layer.items()}
        values = {(repr(d["a"]), repr(d["b"])) if d else None for d in hits.values()}
        if len(values) == 1 and None not in values:
            d = next(iter(hits.values()))
            out.append({"input": name, "a": d["a"], "b": d["b"]})
        else:
            out += [{"input": name.replace("hidden_states", f"hidden_states[{k}]", 1), "a": d["a"], "b": d["b"]}
                    for k, d in hits.items() if d]
    return out


class _Digests:
    """Per-sample content digests from the segments' samples documents, read once per segment."""

    def __init__(self, store) -> None:
        from dfcache.samples import index_of

        self.store, self.idx, self.segs = store, index_of(store), {}

    def __call__(self, partition: str, key: str) -> str | None:
        from dfcache.samples import Segment

        where = self.idx.partition(partition)
        if key not in where:
            return None
        seg_key, pos = where[key]
        seg = self.segs.get(seg_key)
        if seg is None:
            try:
                seg = self.segs[seg_key] = Segment(self.store, seg_key)
            except Exception:  # a damaged segment: verify names it; here its samples are unknown
                self.segs[seg_key] = False
                return None
        return seg.digests[pos] if seg else None


def _state(ka: str, kb: str, pa: str, pb: str, digest) -> str:
    if ka == kb:
        return "same_key"
    da, db = digest(pa, ka), digest(pb, kb)
    if da is None or db is None:
        return "unknown"
    return "same_bytes" if da == db else "different"


def explain(store, spec_a: str, spec_b: str, *, top: int | None = None) -> dict:
    """Everything `dfcache explain` prints, as data (``--json``). ``spec_b`` ``published[:zlab|:ddtree]``:
    the report beside the published figures for its target and suites (runner/suites/published.py)."""
    from dfcache.samples import sample_key

    if spec_b.startswith("published"):
        from ..suites.published import compare

        a = load_side(store, spec_a)
        return compare(a.key, a.doc, a.prompts, a.row, spec_b)
    a, b = load_side(store, spec_a), load_side(store, spec_b)
    sa, sb = a.doc["selection"], b.doc["selection"]
    ta, tb = sa["target"], sb["target"]
    if ta["fingerprint"] != tb["fingerprint"]:
        raise BadInputError(
            f"reports {a.key[:12]} and {b.key[:12]} evaluate different targets: {ta.get('name') or ta.get('path')} "
            f"(fingerprint {ta['fingerprint'][:12]}) and {tb.get('name') or tb.get('path')} (fingerprint "
            f"{tb['fingerprint'][:12]}); their samples share nothing and τ is not comparable prompt by prompt. "
            "Explain two reports of the same target (`dfcache ls --stage report` lists them).")
    differences = _diff(_stage_inputs(sa), _stage_inputs(sb)) + _hidden_state_diffs(sa, sb)
    recorded = []
    for path in _RECORDED:
        fa, fb = _flatten(_get(sa, path), path), _flatten(_get(sb, path), path)
        recorded += [{"field": d["input"], "a": d["a"], "b": d["b"]} for d in _diff(fa, fb)]

    # Prompts, by content: the record digest is the prompts sample's upstream key.
    ra, rb = a.prompts["records"], b.prompts["records"]
    pos_a: dict[str, int] = {}
    for i, r in enumerate(ra):
        pos_a.setdefault(r, i)
    pos_b: dict[str, int] = {}
    for i, r in enumerate(rb):
        pos_b.setdefault(r, i)
    shared = [r for r in pos_a if r in pos_b]
    only_a = [a.prompts["ids"][pos_a[r]] for r in pos_a if r not in pos_b]
    only_b = [b.prompts["ids"][pos_b[r]] for r in pos_b if r not in pos_a]

    # Sample keys of both sides, per shared prompt, derived as the stages derive them.
    digest = _Digests(store)
    pa, pb = sa["stages"], sb["stages"]

    def keys(stages: dict, record: str) -> dict:
        p = sample_key(stages["prompts"]["partition"], record)
        c = sample_key(stages["completions"]["partition"], p)
        t = sample_key(stages["tokens"]["partition"], c)
        return {"completions": c, "tokens": t,
                "hidden_states": {k: sample_key(v["partition"], t) for k, v in stages["hidden_states"].items()}}

    layers = sorted(set(pa["hidden_states"]) & set(pb["hidden_states"]), key=int)
    counts = {s: dict.fromkeys(_ORDER, 0) for s in ("completions", "tokens", "hidden_states")}
    sample_keys = {}
    for r in shared:
        ka, kb = keys(pa, r), keys(pb, r)
        sample_keys[r] = (ka, kb)
        for stage in ("completions", "tokens"):
            counts[stage][_state(ka[stage], kb[stage], pa[stage]["partition"], pb[stage]["partition"], digest)] += 1
        states = [_state(ka["hidden_states"][k], kb["hidden_states"][k], pa["hidden_states"][k]["partition"],
                         pb["hidden_states"][k]["partition"], digest) for k in layers]
        worst = max(states, key=_ORDER.index) if states else "unknown"
        counts["hidden_states"][worst] += 1

    pairs, unpaired_a, unpaired_b = _pairs(a, b)
    rows = []
    for ia, ib in pairs:
        da, db = a.doc["drafters"][ia], b.doc["drafters"][ib]
        ea, eb = da["eval"], db["eval"]
        row_diffs = _diff(_flatten(ea["inputs"], "drafter_eval"), _flatten(eb["inputs"], "drafter_eval"))
        evals = dict.fromkeys(_ORDER, 0)
        per_prompt = []
        for r in shared:
            ka, kb = sample_keys[r]
            evals[_state(sample_key(ea["partition"], ka["tokens"]), sample_key(eb["partition"], kb["tokens"]),
                         ea["partition"], eb["partition"], digest)] += 1
            tau_a = a.prompts["tau_chain"][ia][pos_a[r]]
            tau_b = b.prompts["tau_chain"][ib][pos_b[r]]
            per_prompt.append({"id_a": a.prompts["ids"][pos_a[r]], "id_b": b.prompts["ids"][pos_b[r]],
                               "tau_a": tau_a, "tau_b": tau_b,
                               "delta": None if tau_a is None or tau_b is None else tau_b - tau_a})
        per_prompt.sort(key=lambda p: (p["delta"] is None, -abs(p["delta"] or 0.0)))
        ta_, tb_ = da["tau_chain"], db["tau_chain"]
        rows.append({"a": da["drafter"], "b": db["drafter"], "differences": row_diffs,
                     "tau_chain": {"a": ta_, "b": tb_, "delta": None if ta_ is None or tb_ is None else tb_ - ta_},
                     "evals": evals, "per_prompt": per_prompt if top is None else per_prompt[:top],
                     "shared_prompts": len(per_prompt)})
    return {
        "a": {"report": a.key, "row": None if a.row is None else a.doc["drafters"][a.row]["drafter"]},
        "b": {"report": b.key, "row": None if b.row is None else b.doc["drafters"][b.row]["drafter"]},
        "target": {"name": ta.get("name"), "fingerprint": ta["fingerprint"]},
        "differences": differences, "recorded": recorded,
        "prompts": {"shared": len(shared), "only_a": len(only_a), "only_b": len(only_b),
                    "only_a_ids": only_a, "only_b_ids": only_b},
        "samples": counts, "layers": [int(k) for k in layers], "rows": rows,
        "unpaired": {"a": [a.doc["drafters"][i]["drafter"] for i in unpaired_a],
                     "b": [b.doc["drafters"][i]["drafter"] for i in unpaired_b]},
    }


def _pairs(a: Side, b: Side) -> tuple[list[tuple[int, int]], list[int], list[int]]:
    """Which rows are compared: the rows named, else rows of the same drafter name, else the only
    row of each side."""
    na = [d["drafter"] for d in a.doc["drafters"]]
    nb = [d["drafter"] for d in b.doc["drafters"]]
    if a.row is not None and b.row is not None:
        return [(a.row, b.row)], [], []
    if a.row is not None or b.row is not None:
        one, other, names, flip = (a, b, nb, False) if a.row is not None else (b, a, na, True)
        name = one.doc["drafters"][one.row]["drafter"]
        if name in names:
            j = names.index(name)
        elif len(names) == 1:
            j = 0
        else:
            raise UsageError(f"report {other.key[:12]} has no row of drafter {name!r} and {len(names)} rows; name "
                             f"the one to compare: {other.key[:12]}:ROW (its number or drafter name).")
        return [(j, one.row) if flip else (one.row, j)], [], []
    pairs = [(i, nb.index(n)) for i, n in enumerate(na) if n in nb]
    if not pairs and len(na) == 1 and len(nb) == 1:
        pairs = [(0, 0)]
    paired_a, paired_b = {i for i, _ in pairs}, {j for _, j in pairs}
    return pairs, [i for i in range(len(na)) if i not in paired_a], [j for j in range(len(nb)) if j not in paired_b]


def _v(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if v is None:
        return "null"
    if isinstance(v, str) and len(v) == 32 and all(c in "0123456789abcdef" for c in v):
        return v[:12]
    return str(v)


def _f(v, digits=2, sign=False) -> str:
    if v is None:
        return "-"
    return f"{v:+.{digits}f}" if sign else f"{v:.{digits}f}"


_STATE_WORDS = {"same_key": "same key", "same_bytes": "different keys, same bytes", "different": "different bytes",
                "unknown": "not in this store"}


def format_explain(res: dict, top: int = 10) -> str:
    if "published_comparison" in res:
        from ..suites.published import format_compare

        return format_compare(res)
    a, b = res["a"], res["b"]
    side = lambda s: s["report"][:12] + (f":{s['row']}" if s["row"] else "")  # noqa: E731
    lines = [f"explain: A = report {side(a)}, B = report {side(b)}; target {res['target']['name'] or '?'} "
             f"(fingerprint {res['target']['fingerprint'][:12]})", ""]
    head = "settings that differ, up to the hidden states (key inputs)"
    lines.append(f"{head}:" if res["differences"] else f"{head}: none")
    width = max([len(d["input"]) for d in res["differences"]] + [24])
    lines += [f"  {d['input']:<{width}}  {_v(d['a'])} -> {_v(d['b'])}" for d in res["differences"]]
    if res["recorded"]:
        lines.append("recorded, not keyed (the same keys give the same bytes whatever these say):")
        width = max(len(d["field"]) for d in res["recorded"])
        lines += [f"  {d['field']:<{width}}  {_v(d['a'])} -> {_v(d['b'])}" for d in res["recorded"]]
    p = res["prompts"]
    lines += ["", f"prompts (by content): {p['shared']} shared, {p['only_a']} only in A, {p['only_b']} only in B"]
    for name, ids in (("only in A", p["only_a_ids"]), ("only in B", p["only_b_ids"])):
        if ids:
            lines.append(f"  {name}: {', '.join(map(repr, ids[:10]))}{' ...' if len(ids) > 10 else ''}")
    if p["shared"]:
        lines.append("on the shared prompts (the same key is the same bytes; where keys differ, the stored digests "
                     "say whether the bytes do):")
        rows = (("completions", "completions"), ("tokens", "tokens"),
                ("hidden_states", f"hidden states (layers {', '.join(map(str, res['layers']))})"))
        width = max(len(label) for _, label in rows)
        for stage, label in rows:
            c = res["samples"][stage]
            parts = [f"{c[s]} {_STATE_WORDS[s]}" for s in _ORDER if c[s]]
            lines.append(f"  {label:<{width}}  {'; '.join(parts)}")
    for r in res["rows"]:
        t = r["tau_chain"]
        lines += ["", f"row {r['a']} (A) vs {r['b']} (B): τ chain {_f(t['a'])} vs {_f(t['b'])} "
                      f"(Δ {_f(t['delta'], sign=True)})"]
        if r["differences"]:
            width = max(len(d["input"]) for d in r["differences"])
            lines.append("  drafter eval settings that differ:")
            lines += [f"    {d['input']:<{width}}  {_v(d['a'])} -> {_v(d['b'])}" for d in r["differences"]]
        e = r["evals"]
        lines.append("  evals on the shared prompts: " + "; ".join(f"{e[s]} {_STATE_WORDS[s]}" for s in _ORDER if e[s]))
        if r["per_prompt"]:
            shown = r["per_prompt"][:top]
            more = ""
            if len(shown) < r["shared_prompts"]:
                more = f" ({len(shown)} of {r['shared_prompts']}; --top N shows more)"
            lines.append(f"  per-prompt τ chain on the shared prompts, largest |Δ| first{more}:")
            names = [x["id_a"] if x["id_a"] == x["id_b"] else f"{x['id_a']}|{x['id_b']}" for x in shown]
            idw = max([len(n) for n in names] + [6])
            lines.append(f"    {'prompt':<{idw}}  {'A':>6}  {'B':>6}  {'Δ':>7}")
            for name, x in zip(names, shown):
                lines.append(f"    {name:<{idw}}  {_f(x['tau_a']):>6}  {_f(x['tau_b']):>6}  "
                             f"{_f(x['delta'], sign=True):>7}")
    for name, rows in (("A", res["unpaired"]["a"]), ("B", res["unpaired"]["b"])):
        if rows:
            lines.append(f"\nrows only in {name} (no row of the same drafter on the other side; compare one with "
                         f"KEY:ROW): {', '.join(rows)}")
    return "\n".join(lines)
