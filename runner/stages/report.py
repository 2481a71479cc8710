"""Stage `report`: the drafters side by side — JSON, a markdown table, PNG plots and HTML.

Key recipe (a set-level artifact, the one stage whose key depends on the prompt set and its order;
``KEY`` below, ``build()`` makes its nodes through it)::

    key = compute_key('report', 5, inputs, upstream)
    inputs:
        drafters      display names, in --drafter order
        steps         training steps, same order (null where unknown)
    upstream:
        evals         the set key of each drafter_eval node, same order

where a per-sample node's set key is ``xxh3_128(canonical({"partition": P, "set":
xxh3_128(",".join(sample keys in prompt order))}))``. The manifest's ``sample_refs`` name the eval
samples it was made from (``gc`` keeps them). A run whose report is stored (here or in a remote)
needs nothing under it.

Output: documents ``report`` (the JSON documented in docs/metrics.md), ``markdown`` and ``html``
(a self-contained page: table, plots, per-prompt block views; ``runner/reporting.py``); uint8
arrays ``png_histogram``, ``png_position`` and, when two or more drafters have a training step,
``png_tau_by_step`` (PNG bytes). The files are materialized under
``<store>/reports/<key[:12]>/`` when a run prints them, so a cached run shows them by path
without re-plotting (and without importing matplotlib or torch).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..graph import KeyRecipe, Node, RunContext

# version 2: steps, report.html, tau_by_step.png; 3: "latest" is the highest step; 4: "definitions", the
# legend; 5: per-sample evals
KEY = KeyRecipe("report", 5, inputs={
    "drafters": "display names, in --drafter order",
    "steps": "training steps, same order (null where unknown)",
}, upstream={"evals": "the set key of each drafter_eval node, same order"})
NAME = KEY.stage
VERSION = KEY.version

FILES = {"report.json": "report", "report.md": "markdown", "histogram.png": "png_histogram",
         "acceptance_by_position.png": "png_position", "tau_by_step.png": "png_tau_by_step",
         "report.html": "html"}


def build(ctx: RunContext, evals: list[Node]) -> Node:
    names = [e.payload["drafter"].name for e in evals]
    steps = [getattr(e.payload["drafter"], "step", None) for e in evals]
    return KEY.node(inputs={"drafters": names, "steps": steps}, upstream={"evals": [e.key for e in evals]},
                     needs="cpu", deps=list(evals), label="report",
                     payload={"target_dir": evals[0].payload["target_dir"] if evals else None},
                     summary="report: " + " vs ".join(names))


def _fmt(v, digits=2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def make_report(summaries: list[dict], keys: list[str], steps: list | None = None) -> dict:
    drafters = []
    for s, key, step in zip(summaries, keys, steps or [None] * len(keys)):
        chain = s["chain"]
        drafters.append({
            "drafter": s["drafter"], "key": key, "step": step,
            "tau_chain": chain["tau"],
            "tau_tree": {b: t["tau"] for b, t in s["tree"].items()},
            "histogram": chain["histogram"], "accept_rate_at": chain["accept_rate_at"],
            "tree_histogram": {b: t["histogram"] for b, t in s["tree"].items()},
            "blocks": chain["num_blocks"], "tokens": chain["num_tokens"],
            "tokens_per_block": chain["tokens_per_block"], "responses": chain["num_responses"],
            "hidden_states_backend": s["hidden_states_backend"], "trained_on": s["trained_on"],
            "backend_mismatch": s["backend_mismatch"], "block_size": s["block_size"],
            "max_blocks": s.get("max_blocks"),
        })
    warnings = [
        f"WARNING: drafter {d['drafter']} was trained on {d['trained_on']} hidden states but is evaluated "
        f"on {d['hidden_states_backend']['kernel']} states ({d['hidden_states_backend']['device']}); its "
        "acceptance here may say nothing about real decoding. Extract with --backend "
        f"{d['trained_on']} to compare like with like."
        for d in drafters if d["backend_mismatch"]]
    rule = summaries[0]["rule"] if summaries else None
    return {"end_rule": rule, "drafters": drafters, "warnings": warnings, "definitions": DEFINITIONS}


# What each number is, in the report itself (JSON, markdown, HTML): τ and tokens/block are two
# different averages, and a small tree budget can be below the chain; readers took both for bugs.
DEFINITIONS = {
    "tau_chain": "τ: the mean over responses of each response's mean block value (tokens committed per "
                 "drafter pass: accepted drafts + the bonus token), chain drafting",
    "tau_tree": "τ with a DDTree of N drafted nodes (budget N): a path of at most N drafts is verified, so "
                "a small N can be below the chain, which verifies all block_size - 1 drafts",
    "tokens_per_block": "all committed tokens / all blocks, pooled over responses (long responses weigh "
                        "more), so τ can be above or below it",
    "blocks": "chain blocks over all responses", "responses": "responses with at least one block count toward τ",
}
LEGEND = ("τ chain = mean over responses of each response's mean tokens per block (accepted + bonus); "
          "tokens/block = all tokens / all blocks, pooled, so τ can exceed it; τ tree-N = τ with a DDTree "
          "of N drafted nodes, which at a small N can be below the chain.")


def table(report: dict) -> tuple[list[str], list[list[str]]]:
    """The summary table's header and rows (the markdown and the HTML show the same)."""
    budgets = sorted({int(b) for d in report["drafters"] for b in d["tau_tree"]})
    stepped = any(d.get("step") is not None for d in report["drafters"])
    head = (["step"] if stepped else []) + ["drafter", "τ chain"] + [f"τ tree-{b}" for b in budgets] + \
        ["blocks", "tokens/block", "responses", "states"]
    rows = []
    for d in report["drafters"]:
        hs = d["hidden_states_backend"]
        states = f"{hs['kernel']}/{hs['device']}/{hs['dtype']}" + (" ⚠ trained on " + d["trained_on"]
                                                                   if d["backend_mismatch"] else "")
        step = [] if not stepped else ["-" if d.get("step") is None else str(d["step"])]
        rows.append(step + [d["drafter"], _fmt(d["tau_chain"])] + [_fmt(d["tau_tree"].get(str(b))) for b in budgets]
                    + [str(d["blocks"]), _fmt(d["tokens_per_block"]), str(d["responses"]), states])
    return head, rows


def markdown_table(report: dict) -> str:
    head, rows = table(report)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    text = "\n".join(lines)
    if report["warnings"]:
        text += "\n\n" + "\n".join(f"**{w}**" for w in report["warnings"])
    text += f"\n\n{LEGEND}"
    text += (f"\n\nEnd rule: {report['end_rule']} (each block capped at the completion tokens left after "
             "its root; see docs/metrics.md).")
    return text


def _plots(report: dict) -> dict[str, bytes]:
    """PNG bytes by artifact array name."""
    from .. import reporting

    plt = reporting.pyplot()
    drafters = report["drafters"]
    pngs = {"png_histogram": reporting.histograms_png(
        [(f"{d['drafter']} (τ={_fmt(d['tau_chain'])})", d["histogram"]) for d in drafters], "Acceptance histogram")}
    fig, ax = plt.subplots(figsize=(7, 4))
    for d in drafters:
        rates = d["accept_rate_at"]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=d["drafter"])
    ax.set_xlabel("draft position j")
    ax.set_ylabel("P(first j drafts accepted)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Acceptance by position (chain)")
    ax.legend()
    pngs["png_position"] = reporting.png(fig)
    stepped = [d for d in drafters if d.get("step") is not None]
    if len(stepped) >= 2:
        budgets = sorted({int(b) for d in drafters for b in d["tau_tree"]})
        points = [reporting.Point(d["drafter"], d["step"], d["tau_chain"], d["tau_tree"], d["histogram"], d["key"])
                  for d in sorted(stepped, key=lambda d: d["step"])]
        pngs["png_tau_by_step"] = reporting.tau_by_step_png(points, None, budgets)
    return pngs


def html_page(store, report: dict, pngs: dict[str, bytes], target_dir: str | None, evals: list[Node]) -> str:
    """The report as one self-contained page: the table, the plots, and per-prompt block views of
    every drafter (when there are more than three: of the latest step, the best, and up to two
    drafters without a step, such as references)."""
    from .. import reporting
    from .drafter_eval import read_responses
    from .tokens import read_tokens

    drafters = report["drafters"]
    head, rows = table(report)
    best = max(range(len(drafters)), key=lambda i: drafters[i]["tau_chain"] or 0) if drafters else None
    stepped = [i for i, d in enumerate(drafters) if d.get("step") is not None]
    # The latest checkpoint is the highest step; drafters without one (references) are never "latest".
    latest = max(stepped, key=lambda i: drafters[i]["step"]) if stepped else None
    classes = [" ".join(c for c, hit in (("best", i == best), ("latest", i == latest)) if hit)
               for i in range(len(drafters))]
    unstepped = [i for i in range(len(drafters)) if i not in stepped]
    shown = list(range(len(drafters))) if len(drafters) <= 3 else \
        sorted({i for i in (latest, best) if i is not None} | set(unstepped[:2]))
    views = []
    for i in shown:
        d = drafters[i]
        role = "latest: " if i == latest else ("best: " if i == best and len(drafters) > 3 else "")
        step = f" (step {d['step']})" if d.get("step") is not None else ""
        views.append(reporting.DrafterView(f"{role}{d['drafter']}{step}", read_responses(store, evals[i]),
                                           int(d["block_size"])))
    toks = read_tokens(store, evals[0].payload["tokens"]) if drafters else None
    budgets = sorted({int(b) for d in drafters for b in d["tau_tree"]})
    section = ("<h2>Per prompt</h2>" + reporting.legend_html(max((v.block_size for v in views), default=2))
               + reporting.per_prompt_html(views, toks, reporting.TokenText.from_target(target_dir), budgets))
    captions = {"png_tau_by_step": "τ by training step", "png_histogram": "acceptance histogram",
                "png_position": "acceptance by position"}
    return reporting.page(
        title="dfcache report: " + " vs ".join(d["drafter"] for d in drafters[:4]) + (" …" if len(drafters) > 4 else ""),
        subtitle=f"end rule {report['end_rule']}; {len(drafters)} drafter(s). {LEGEND}",
        table=reporting.table_html(head, list(zip(classes, rows))),
        images=[(captions[k], pngs[k]) for k in captions if k in pngs], sections=[section],
        warnings=report["warnings"])


def produce(ctx: RunContext, nodes: list[Node]) -> None:
    import numpy as np

    from .drafter_eval import read_summary

    for node in nodes:
        evals = node.deps
        report = make_report([read_summary(ctx.store, e) for e in evals], [e.key for e in evals],
                             node.inputs.get("steps"))
        pngs = _plots(report)
        target_dir = node.payload.get("target_dir") if isinstance(node.payload, dict) else None
        page = html_page(ctx.store, report, pngs, target_dir, evals)
        refs = [{"partition": e.partition.key, "keys": list(dict.fromkeys(e.sample_keys))} for e in evals]
        with ctx.store.writer(node.key, stage=NAME, stage_version=VERSION, inputs=node.inputs,
                              upstream=node.upstream, summary=node.summary, sample_refs=refs) as w:
            w.put_json("report", report)
            w.put_json("markdown", markdown_table(report))
            w.put_json("html", page)
            for name, png in pngs.items():
                w.write_array(name, np.frombuffer(png, dtype=np.uint8))


def materialize(store, key: str) -> dict[str, Path]:
    """Write the report's files under <store>/reports/<key[:12]>/ (once) and return their paths."""
    art = store.open(key)
    reports = store.local_dir("reports")
    if reports is None:
        return {}
    out = reports / key[:12]
    paths = {filename: out / filename for filename, name in FILES.items()
             if name in art.manifest.blobs or name in art.manifest.arrays}  # e.g. no tau_by_step.png without steps
    for filename, path in paths.items():
        name = FILES[filename]
        if path.exists():
            continue
        out.mkdir(parents=True, exist_ok=True)
        if name in art.manifest.blobs:
            doc = art.json(name)
            if filename == "report.json":  # what `run eval --json` prints, less the run's own figures
                doc = {**doc, "report_key": key, "files": {k: str(v) for k, v in paths.items()}}
            data = (doc if isinstance(doc, str) else json.dumps(doc, indent=1)).encode() + b"\n"
        else:
            data = art.array(name).read().tobytes()
        tmp = path.with_name(f".{filename}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return paths
