"""τ per prompt set, overall and per traffic mix, for a run over several sets (or with ``--mix``),
added to the report when it is shown (the stored report, and its key, are the run's prompt set
as one: a set's table is a cut of its per-response numbers by the ``SET/ID`` ids).

τ of a set is the report's τ over that set's responses (the mean of each response's mean block
value, runner/stages/drafter_eval/metrics.py ``aggregate``). The mix τ is ``Σ w_s τ_s``; its
interval is a percentile bootstrap over prompts: each replicate draws every set's responses with
replacement (so each set keeps its size and weight), ``BOOTSTRAP`` replicates, a fixed seed so a
cached run shows the same interval.
"""

from __future__ import annotations

from pathlib import Path

from . import sets

BOOTSTRAP = 2000
LEVEL = 0.95
SEED = 0


def _per_response(values: list[list[int]]) -> list[float]:
    return [sum(v) / len(v) for v in values if len(v)]


def _tau(values: list[list[int]]) -> float | None:
    means = _per_response(values)
    return sum(means) / len(means) if means else None


def mix_interval(per_set: dict[str, list[float]], weights: dict[str, float]) -> dict:
    """``{"tau", "low", "high", "level", "replicates"}`` of ``Σ w_s mean(per_set[s])`` (the
    per-response τ of each set), the interval a percentile bootstrap over responses within sets."""
    import numpy as np

    used = {s: np.asarray(per_set[s], dtype=np.float64) for s, w in weights.items() if w > 0}
    empty = [s for s, v in used.items() if v.size == 0]
    if empty:
        return {"tau": None, "low": None, "high": None, "level": LEVEL, "replicates": 0,
                "note": f"no responses with a block in {', '.join(empty)}"}
    tau = float(sum(weights[s] * v.mean() for s, v in used.items()))
    rng = np.random.default_rng(SEED)
    reps = np.zeros(BOOTSTRAP)
    for s, v in used.items():
        draws = rng.integers(0, v.size, size=(BOOTSTRAP, v.size))
        reps += weights[s] * v[draws].mean(axis=1)
    low, high = np.quantile(reps, [(1 - LEVEL) / 2, 1 - (1 - LEVEL) / 2])
    return {"tau": tau, "low": float(low), "high": float(high), "level": LEVEL, "replicates": BOOTSTRAP}


def per_set(ids: list[str], names: list[str], rows: list[dict], responses: list[list[dict]],
            mix: dict[str, float] | None, turned: set[str] = frozenset()) -> dict:
    """The per-set document: for each drafter row, τ chain and every tree budget per set, overall,
    and under ``mix``. ``responses[i]``: row i's eval documents in prompt order (``chain`` and
    ``tree`` block values). ``turned``: the sets with later turns (suite:mt-bench): a set's τ is
    over all its turns' responses, as the peers average them, and each turn has a column of its
    own beside it (``mt-bench/turn1``, ``mt-bench/turn2``)."""
    several = len(names) > 1
    groups: dict[str, list[int]] = {n: [] for n in names}
    for pos, pid in enumerate(ids):
        groups[sets.group_of(pid) if several else names[0]].append(pos)
    columns = []
    for n in names:
        columns.append(n)
        if n in turned:
            by_turn: dict[str, list[int]] = {}
            for pos in groups[n]:
                by_turn.setdefault(f"{n}/turn{sets.turn_of(ids[pos])}", []).append(pos)
            for t in sorted(by_turn, key=lambda c: int(c.rpartition("turn")[2])):
                groups[t] = by_turn[t]
                columns.append(t)
    out_rows = []
    for row, docs in zip(rows, responses):
        budgets = sorted({int(b) for d in docs for b in d.get("tree", {})})
        measures = {"chain": [d["chain"] for d in docs]}
        for b in budgets:
            measures[f"tree {b}"] = [d["tree"].get(str(b), []) for d in docs]
        for label in sorted({k for d in docs for k in d.get("eagle_tree", {})}):  # EAGLE-3's dynamic trees
            measures[label] = [d["eagle_tree"].get(label, []) for d in docs]
        entry = {"drafter": row["drafter"], "sets": {}, "overall": {}, "mix": {}}
        for name, positions in groups.items():
            entry["sets"][name] = {"prompts": len(positions),
                                   **{m: _tau([v[p] for p in positions]) for m, v in measures.items()}}
        entry["overall"] = {"prompts": len(ids), **{m: _tau(v) for m, v in measures.items()}}
        if mix is not None:
            entry["mix"] = {m: mix_interval({n: _per_response([v[p] for p in groups[n]]) for n in mix}, mix)
                            for m, v in measures.items()}
        entry["histograms"] = {name: _histogram([docs[p]["chain"] for p in groups[name]], row) for name in names}
        out_rows.append(entry)
    return {"sets": columns, "mix": mix, "rows": out_rows,
            "definition": "τ over each set's responses (as the report's τ); mix: Σ weight × set τ, "
                          f"{LEVEL:.0%} percentile bootstrap over prompts within sets ({BOOTSTRAP} replicates)"}


def _histogram(values: list[list[int]], row: dict) -> list[int]:
    size = int(row.get("block_size") or max([x for v in values for x in v] or [1]))
    hist = [0] * (size + 1)
    for v in values:
        for x in v:
            if 0 <= x <= size:
                hist[x] += 1
    return hist


def _fmt(v) -> str:
    return "-" if v is None else f"{v:.2f}"


def markdown(doc: dict) -> str:
    other = doc.get("other_thinking")
    out = _table(doc, doc["rows"], f", thinking {'on' if doc.get('enable_thinking') else 'off'}" if other else "")
    if other:
        on = "on" if other["enable_thinking"] else "off"
        out += "\n\n" + _table(doc, other["rows"], f", thinking {on} (stored: the same run with "
                                 f"--{'' if other['enable_thinking'] else 'no-'}enable-thinking)")
    pubs = [p for p in doc.get("published") or [] if not any(d["setting"] == "temperature" for d in p["differs"])]
    if pubs:
        lines = ["", "published (not measured here; the settings they differ in after each row):", "",
                 "| source | drafter | τ | " + " | ".join(doc["sets"]) + " |", "|" + "---|" * (3 + len(doc["sets"]))]
        for p in pubs:
            lines.append(f"| {p['source']} | {p['drafter']} | {p['method']} | "
                         + " | ".join(_fmt(p["tau"].get(n)) for n in doc["sets"]) + " |")
        lines.append("")
        for p in pubs:
            diff = "; ".join(f"{d['setting']}: run {d['run']}, published {d['published']}" for d in p["differs"])
            lines.append(f"- {p['source']}, {p['drafter']}, {p['method']}: {diff or 'no setting differs'}")
        out += "\n" + "\n".join(lines)
    return out


def _cells(doc: dict, rows: list[dict], what: str) -> tuple[str, list[str], list[list[str]]]:
    """(title, header, rows) of one table: τ (chain, each budget) per set and turn, overall, the mix."""
    names = doc["sets"]
    counts = {n: rows[0]["sets"][n]["prompts"] for n in names} if rows else {}
    head = ["drafter", "τ"] + [f"{n} ({counts.get(n, 0)})" for n in names] + ["overall"]
    mix = doc.get("mix")
    if mix:
        head.append("mix " + ",".join(f"{n}={w:g}" for n, w in mix.items()) + f" [{LEVEL:.0%} interval]")
    title = ("τ per prompt set (" + ("prompts per set in brackets" if len(names) > 1 else names[0]) + what
             + ("; a multi-turn set's τ is over all its turns, as the peers average them" if any(
                 "/turn" in n for n in names) else "") + "):")
    out = []
    for r in rows:
        for m in r["overall"]:
            if m == "prompts":
                continue
            cells = [r["drafter"], m] + [_fmt(r["sets"][n][m]) for n in names] + [_fmt(r["overall"][m])]
            if mix:
                iv = r["mix"][m]
                cells.append("-" if iv["tau"] is None else f"{iv['tau']:.2f} [{iv['low']:.2f}, {iv['high']:.2f}]")
            out.append(cells)
    return title, head, out


def _table(doc: dict, rows: list[dict], what: str) -> str:
    title, head, cells = _cells(doc, rows, what)
    lines = [title, "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    return "\n".join(lines + ["| " + " | ".join(c) + " |" for c in cells])


def html(doc: dict) -> str:
    """The tables of :func:`markdown` as report.html shows them (the published rows are in report.md)."""
    import html as _html

    from ..core.reporting import table_html

    parts = [(doc["rows"], f", thinking {'on' if doc.get('enable_thinking') else 'off'}" if doc.get("other_thinking")
              else "")]
    other = doc.get("other_thinking")
    if other:
        parts.append((other["rows"], f", thinking {'on' if other['enable_thinking'] else 'off'}"))
    out = ["<h2>Per prompt set</h2>"]
    for i, (rows, what) in enumerate(parts):
        title, head, cells = _cells(doc, rows, what)
        out.append(f"<p>{_html.escape(title)}</p>" + table_html(head, [("", c) for c in cells], f"prompt-sets-{i}"))
    return "".join(out)


def plots(doc: dict, out: Path | None) -> dict[str, Path]:
    """One acceptance histogram per set (the drafters side by side), under the report's folder;
    written once (the name holds the set and the prompts it counts)."""
    names = [n for n in doc["sets"] if doc["rows"] and n in doc["rows"][0]["histograms"]]  # sets, not turns
    if out is None or len(names) < 2:
        return {}
    files = {}
    for name in names:
        n = doc["rows"][0]["sets"][name]["prompts"] if doc["rows"] else 0
        path = out / f"set-{name}-{n}-histogram.png"
        files[path.name] = path
        if path.exists():
            continue
        from ..core import reporting

        png = reporting.histograms_png(
            [(f"{r['drafter']} (τ={_fmt(r['sets'][name]['chain'])})", r["histograms"][name]) for r in doc["rows"]],
            f"Acceptance histogram (chain), {name}")
        out.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_bytes(png)
        tmp.replace(path)
    return files


def turned_sets(nodes, names: list[str]) -> set[str]:
    """The sets of a run's graph whose records have later turns (their ids ``ID/turnK``)."""
    prompts = next((n for n in nodes if n.stage == "prompts"), None)
    if prompts is None or not prompts.spec.turns or not any(sets.turn_of(i) > 1 for i in prompts.ids):
        return set()
    return {sets.group_of(prompts.ids[b]) if len(names) > 1 else names[0] for b in prompts.spec.turns}


def section(store, nodes, opts, report_key: str, read_responses, other=None) -> dict | None:
    """(document, markdown, files) of the per-set tables of a run, or None for a run of one set
    without ``--mix`` and without published figures for its target and suites.
    ``read_responses(store, eval_node)``: an eval's response documents; ``other``: the nodes of
    this run with thinking the other way, when all of them are stored (shown side by side)."""
    from . import published

    names = sets.names(opts.prompts)
    suites = [sets.set_name(s) for s in sets.specs(opts.prompts) if s.startswith("suite:")]
    pubs = published.for_run(opts.target, suites)
    turned = turned_sets(nodes, names)
    if len(names) < 2 and opts.mix is None and not pubs and not turned:
        return None
    mix = sets.parse_mix(opts.mix, names) if opts.mix is not None else None

    def cut(graph):
        prompts = next(n for n in graph if n.stage == "prompts")
        evals = [n for n in graph if n.stage == "drafter_eval"]
        rows = [{"drafter": e.spec.drafter.name, "block_size": e.spec.drafter.block_size} for e in evals]
        return per_set(list(prompts.ids), names, rows, [read_responses(store, e) for e in evals], mix,
                       turned_sets(graph, names))

    doc = cut(nodes)
    reports = store.local_dir("reports")
    files = plots(doc, reports / report_key[:12] if reports is not None else None)
    doc["enable_thinking"] = bool(opts.enable_thinking)
    if other is not None:
        doc["other_thinking"] = {"enable_thinking": not opts.enable_thinking, "rows": cut(other)["rows"]}
    run = {"temperature": float(opts.temperature), "max_new_tokens": opts.max_new_tokens,
           "enable_thinking": bool(opts.enable_thinking), "dtype": opts.dtype,
           "block_size": doc["rows"][0].get("block_size") if doc["rows"] else None,
           "tree_budgets": list(opts.tree_budgets),
           # a multi-turn suite's sample count is its records' (the first turns), as the peers count it
           "prompts": {n: doc["rows"][0]["sets"][n + "/turn1" if n in turned else n]["prompts"] for n in suites}
           if doc["rows"] else {},
           "mt_bench_turns": "all turns" if "mt-bench" in turned else "first turns"}
    doc["published"] = [{**p.to_dict(), "tau": {n: p.tau[n] for n in names if n in p.tau},
                         "differs": published.differences(p, run)} for p in pubs]
    for r in doc["rows"] + (doc.get("other_thinking") or {}).get("rows", []):
        r.pop("histograms", None)
    text = markdown(doc)
    if reports is not None:  # as report.md and report.json: what the last run that printed them said
        import json

        out = reports / report_key[:12]
        out.mkdir(parents=True, exist_ok=True)
        for name, data in (("prompt_sets.md", text + "\n"), ("prompt_sets.json", json.dumps(doc, indent=1) + "\n")):
            tmp = out / f".{name}.tmp"
            tmp.write_text(data, encoding="utf-8")
            tmp.replace(out / name)
            files[name] = out / name
    return {"doc": doc, "markdown": text, "html": html(doc), "files": files}
