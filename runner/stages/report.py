"""Stage `report`: the drafters side by side — JSON, a markdown table, PNG plots and HTML.

Key recipe (a set-level artifact, the one stage whose key depends on the prompt set and its order;
``KEY`` below, ``build()`` makes its nodes through it)::

    key = compute_key('report', 6, inputs, upstream)
    inputs:
        drafters      display names, in --drafter order
        steps         training steps, same order (null where unknown)
    upstream:
        evals         the set key of each drafter_eval node, same order

where a per-sample node's set key is ``xxh3_128(canonical({"partition": P, "set":
xxh3_128(",".join(sample keys in prompt order))}))``. The manifest's ``sample_refs`` name the eval
samples it was made from (``gc`` keeps them). A run whose report is stored (here or in a remote)
needs nothing under it.

Output: documents ``report`` (the stored facts of the JSON documented in docs/metrics.md: the
numbers, the whole selection, each row's completion sources; no verdict), ``markdown`` (the same,
as text), ``html`` (a self-contained page: plots, selection, per-prompt block views;
``runner/core/reporting.py``; the summary table and banner are put in when it is shown) and
``prompts`` (per prompt: id, record digest, each row's τ; what ``dfcache explain`` compares);
uint8 arrays ``png_histogram``, ``png_position`` and, when two or more drafters have a training
step, ``png_tau_by_step`` (PNG bytes).

Shown (runner/core/report_view.py): what depends on options outside the key (``--trained-on``,
``--accept-retokenized``) is decided when a run prints the report, and the files under
``<store>/reports/<key[:12]>/`` are written then, as that run shows them, so a cached run shows
them by path without re-plotting (and without importing matplotlib or torch).
"""

from __future__ import annotations

import os

from ..core import report_view
from ..core.graph import KeyRecipe, Node, ReportSpec, RunContext

# version 2: steps, report.html, tau_by_step.png; 3: "latest" is the highest step; 4: "definitions", the
# legend; 5: per-sample evals; 6: self-describing (the selection, each row's completion sources and
# drafter identity, the "prompts" document), and no verdict stored: trained_on/backend_mismatch and
# the warnings moved to when the report is shown (runner/core/report_view.py), as the trust rules ask.
KEY = KeyRecipe("report", 6, inputs={
    "drafters": "display names, in --drafter order",
    "steps": "training steps, same order (null where unknown)",
}, upstream={"evals": "the set key of each drafter_eval node, same order"})
NAME = KEY.stage
VERSION = KEY.version

FILES = report_view.FILES  # file name -> document or array of the artifact


def build(ctx: RunContext, evals: list[Node]) -> Node:
    names = [e.spec.drafter.name for e in evals]
    steps = [getattr(e.spec.drafter, "step", None) for e in evals]
    return KEY.node(inputs={"drafters": names, "steps": steps}, upstream={"evals": [e.key for e in evals]},
                     needs="cpu", deps=list(evals), label="report",
                     spec=ReportSpec(target_dir=evals[0].spec.target_dir if evals else None),
                     summary="report: " + " vs ".join(names))


def _fmt(v, digits=2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def make_report(summaries: list[dict], keys: list[str], steps: list | None = None, *,
                rows: list[dict] | None = None, selection: dict | None = None) -> dict:
    """The stored report: facts only. ``rows``: per drafter, what the selection adds to its row
    (path, fingerprint, completion sources, its eval's key inputs). The verdicts (a backend
    mismatch under --trained-on, the refusal of unaccepted retokenized ids) are added when the
    report is shown (runner/core/report_view.py), never stored."""
    drafters = []
    for i, (s, key) in enumerate(zip(summaries, keys)):
        chain = s["chain"]
        step = (steps or [None] * len(keys))[i]
        drafters.append({
            "drafter": s["drafter"], "family": s.get("family", "dflash"), "key": key, "step": step,
            "tau_chain": chain["tau"],
            "tau_tree": {b: t["tau"] for b, t in s["tree"].items()},
            "histogram": chain["histogram"], "accept_rate_at": chain["accept_rate_at"],
            "tree_histogram": {b: t["histogram"] for b, t in s["tree"].items()},
            **({"tau_eagle_tree": {k: t["tau"] for k, t in s["eagle_tree"].items()}} if s.get("eagle_tree") else {}),
            "blocks": chain["num_blocks"], "tokens": chain["num_tokens"],
            "tokens_per_block": chain["tokens_per_block"], "responses": chain["num_responses"],
            "hidden_states_backend": s["hidden_states_backend"], "trained_on_declared": s.get("trained_on_declared"),
            "block_size": s["block_size"], "max_blocks": s.get("max_blocks"),
            **((rows or [{}] * len(keys))[i]),
        })
    rule = summaries[0]["rule"] if summaries else None
    out = {"end_rule": rule, "drafters": drafters, "definitions": DEFINITIONS}
    if selection is not None:
        out["selection"] = selection
    return out


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
    "completions": "where each row's completion token ids came from: server ids, local greedy (exact); "
                   "retokenized, verified / unverified (accepted) / unchecked (rebuilt from text)",
}
LEGEND = report_view.LEGEND


def markdown_table(report: dict) -> str:
    """The stored markdown: the facts, without the verdicts of any run (report_view.markdown of the
    shown report is what runs print and report.md holds)."""
    return report_view.markdown(report)


def _plots(report: dict) -> dict[str, bytes]:
    """PNG bytes by artifact array name."""
    from ..core import reporting

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


def html_page(store, report: dict, pngs: dict[str, bytes], target_dir: str | None, evals: list[Node],
              responses: list[list[dict]] | None = None) -> str:
    """The report as one self-contained page: the plots, the selection, and per-prompt block views
    of every drafter (when there are more than three: of the latest step, the best, and up to two
    drafters without a step, such as references). The banner, the warnings and the summary table
    are left to when the page is shown (``report_view.SHOW_MARK``): a row's backend-mismatch mark
    depends on --trained-on."""
    from ..core import reporting
    from .drafter_eval import read_responses
    from .tokens import read_tokens

    drafters = report["drafters"]
    best = max(range(len(drafters)), key=lambda i: drafters[i]["tau_chain"] or 0) if drafters else None
    stepped = [i for i, d in enumerate(drafters) if d.get("step") is not None]
    # The latest checkpoint is the highest step; drafters without one (references) are never "latest".
    latest = max(stepped, key=lambda i: drafters[i]["step"]) if stepped else None
    unstepped = [i for i in range(len(drafters)) if i not in stepped]
    shown = list(range(len(drafters))) if len(drafters) <= 3 else \
        sorted({i for i in (latest, best) if i is not None} | set(unstepped[:2]))
    views = []
    for i in shown:
        d = drafters[i]
        role = "latest: " if i == latest else ("best: " if i == best and len(drafters) > 3 else "")
        step = f" (step {d['step']})" if d.get("step") is not None else ""
        docs = responses[i] if responses is not None else read_responses(store, evals[i])
        views.append(reporting.DrafterView(f"{role}{d['drafter']}{step}", docs, int(d["block_size"])))
    toks = read_tokens(store, evals[0].spec.tokens) if drafters else None
    budgets = sorted({int(b) for d in drafters for b in d["tau_tree"]})
    section = ("<h2>Per prompt</h2>" + reporting.legend_html(max((v.block_size for v in views), default=2))
               + reporting.per_prompt_html(views, toks, reporting.TokenText.from_target(target_dir), budgets))
    import html as _html

    selection = ("<h2>Selection</h2><ul class=\"selection\">"
                 + "".join(f"<li>{_html.escape(line)}</li>" for line in report_view.selection_lines(report))
                 + "</ul>")
    captions = {"png_tau_by_step": "τ by training step", "png_histogram": "acceptance histogram",
                "png_position": "acceptance by position"}
    return reporting.page(
        title="dfcache report: " + " vs ".join(d["drafter"] for d in drafters[:4]) + (" …" if len(drafters) > 4 else ""),
        subtitle=f"end rule {report['end_rule']}; {len(drafters)} drafter(s). {LEGEND}",
        table=report_view.SHOW_MARK,
        images=[(captions[k], pngs[k]) for k in captions if k in pngs], sections=[selection, section])


# Provenance fields of the hidden-state segments a report names (what made the states, not keyed).
_HS_PROVENANCE = ("model_class", "torch_cuda", "gpu", "device")
NOT_EXACT_IDS = 20  # prompt ids kept per label that is not exact (messages name them)


def _distinct(values: list):
    """One value when all agree, else the distinct values in first-seen order."""
    out: list = []
    for v in values:
        if v not in out:
            out.append(v)
    return out[0] if len(out) == 1 else (out or None)


def _segments_provenance(store, partition: str, keys: list[str]) -> list[dict]:
    """The provenance of the segments holding ``keys`` of ``partition`` (empty for samples not in
    this store: a report can be made from stored evals whose upstream was never pulled)."""
    from dfcache.samples import index_of

    idx = index_of(store)
    where = idx.partition(partition)
    segs = {where[k][0] for k in dict.fromkeys(keys) if k in where}
    manifests = idx.segments(partition)
    return [manifests[s].provenance for s in sorted(segs) if s in manifests]


def completion_sources(store, tokens_node: Node) -> tuple[dict[str, int], dict[str, list[str]]]:
    """Per label (runner/core/completion_source.py), how many of the set's tokens samples have it, and
    the first prompt ids of each label that is not exact."""
    from dfcache.samples import SampleSet

    from ..core.completion_source import EXACT, label_of

    counts: dict[str, int] = {}
    ids: dict[str, list[str]] = {}
    docs = SampleSet(store, tokens_node.partition.key, tokens_node.sample_keys).docs()
    for pid, doc in zip(tokens_node.ids, docs):
        label = label_of(doc)
        counts[label] = counts.get(label, 0) + 1
        if label not in EXACT and len(ids.setdefault(label, [])) < NOT_EXACT_IDS:
            ids[label].append(pid)
    return counts, ids


def describe(ctx: RunContext, evals: list[Node]) -> dict:
    """The whole selection the report was made from (docs/metrics.md "The selection"), from the
    graph's nodes and the upstream segments' manifests: nothing is recomputed."""
    import dfcache

    opts = ctx.options
    tok = evals[0].spec.tokens
    comp = tok.spec.completions
    prompts = comp.spec.prompts
    layers: dict[int, Node] = {}
    for e in evals:
        for ln in e.spec.layers:
            layers[ln.spec.layer] = ln
    ci = comp.inputs
    comp_prov = _segments_provenance(ctx.store, comp.partition.key, comp.sample_keys)
    server = _distinct([p.get("server") for p in comp_prov if p.get("server")]) or \
        getattr(comp.spec, "server", None)
    served = _distinct([p.get("served_model") for p in comp_prov if p.get("served_model")]) or ci.get("served_model")
    counts, not_exact = completion_sources(ctx.store, tok)
    hs_prov = [p for k in sorted(layers) for p in _segments_provenance(ctx.store, layers[k].partition.key,
                                                                        layers[k].sample_keys)]
    versions: dict = {}
    for p in hs_prov:
        for name, v in (p.get("versions") or {}).items():
            versions.setdefault(name, []).append(v)
    first = layers[min(layers)] if layers else None
    spec = prompts.summary.partition(" prompts from ")[2] if prompts.summary else opts.prompts
    target_dir = tok.spec.target_dir
    e0 = evals[0].inputs
    return {
        "target": {"name": opts.target, "path": os.path.abspath(target_dir) if target_dir else None,
                   "fingerprint": tok.inputs["target"], "revision": opts.target_revision,
                   "tokenizer": tok.inputs["tokenizer"], "chat_template": tok.inputs["chat_template"]},
        "prompts": {"source": spec or opts.prompts, "digest": prompts.key, "count": len(prompts.sample_keys),
                    "partition": prompts.partition.key},
        "completions": {"source": ci["endpoint"], "server": server, "served_model": served,
                        "temperature": ci["temperature"], "top_p": ci["top_p"], "seed": ci["seed"],
                        "max_new_tokens": ci["max_new_tokens"], "enable_thinking": ci["enable_thinking"],
                        "chat_template": ci["chat_template"], "backend": ci.get("backend"),
                        "ids": counts, "not_exact": not_exact, "key": comp.key, "partition": comp.partition.key},
        "tokens": {"tokenizer": tok.inputs["tokenizer"], "chat_template": tok.inputs["chat_template"],
                   "enable_thinking": tok.inputs["enable_thinking"], "key": tok.key, "partition": tok.partition.key},
        "hidden_states": {"backend": first.inputs["backend"] if first else None, "layers": sorted(layers),
                          "versions": {k: _distinct(v) for k, v in sorted(versions.items())},
                          **{f: _distinct([p.get(f) for p in hs_prov if p.get(f) is not None])
                             for f in _HS_PROVENANCE},
                          "partitions": {str(k): layers[k].partition.key for k in sorted(layers)}},
        "eval": {"end_rule": e0["end_rule"], "tree_budgets": e0["tree_budgets"], "max_blocks": e0["max_blocks"],
                 "dtype": e0["dtype"], "device": e0["device"]},
        # Each stage's key inputs, by the names `dfcache explain` gives differences.
        "stages": {"prompts": {"partition": prompts.partition.key, "inputs": dict(prompts.inputs)},
                   "completions": {"partition": comp.partition.key, "inputs": dict(ci)},
                   "tokens": {"partition": tok.partition.key, "inputs": dict(tok.inputs)},
                   "hidden_states": {str(k): {"partition": layers[k].partition.key, "inputs": dict(layers[k].inputs)}
                                     for k in sorted(layers)}},
        "dfcache_version": dfcache.__version__,
    }


def _row(e: Node, counts: dict[str, int]) -> dict:
    ref = e.spec.drafter
    return {"path": os.path.abspath(ref.path), "fingerprint": ref.fingerprint,
            "target_layer_ids": list(ref.target_layer_ids), "mask_token_id": ref.mask_token_id,
            "completions": report_view.sources_text(counts), "completion_sources": counts,
            "eval": {"partition": e.partition.key, "inputs": dict(e.inputs)}}


def _mean(values) -> float | None:
    return sum(values) / len(values) if values else None


def produce(ctx: RunContext, nodes: list[Node]) -> None:
    import numpy as np

    from .drafter_eval import read_responses, read_summary

    for node in nodes:
        evals = node.deps
        responses = [read_responses(ctx.store, e) for e in evals]
        selection = describe(ctx, evals) if evals else None
        by_tokens: dict[str, dict] = {}
        for e in evals:  # every row of one graph shares one tokens node; counted once per set
            tok = e.spec.tokens
            if tok.key not in by_tokens:
                by_tokens[tok.key] = completion_sources(ctx.store, tok)[0]
        rows = [_row(e, by_tokens[e.spec.tokens.key]) for e in evals]
        report = make_report([read_summary(ctx.store, e, docs=r) for e, r in zip(evals, responses)],
                             [e.key for e in evals], node.inputs.get("steps"), rows=rows, selection=selection)
        pngs = _plots(report)
        target_dir = getattr(node.spec, "target_dir", None)
        page = html_page(ctx.store, report, pngs, target_dir, evals, responses)
        # Per prompt, what `dfcache explain` compares: the prompt's id and record digest (every
        # stage's sample key derives from it and the partitions in "selection"), and each row's τ.
        per_prompt = {"ids": list(evals[0].ids) if evals else [],
                      "records": list(evals[0].spec.tokens.spec.completions.spec.prompts
                                      .upstream_samples) if evals else [],
                      "tau_chain": [[_mean(r["chain"]) for r in rs] for rs in responses]}
        refs = [{"partition": e.partition.key, "keys": list(dict.fromkeys(e.sample_keys))} for e in evals]
        with ctx.store.writer(node.key, stage=NAME, stage_version=VERSION, inputs=node.inputs,
                              upstream=node.upstream, summary=node.summary, sample_refs=refs) as w:
            w.put_json("report", report)
            w.put_json("markdown", markdown_table(report))
            w.put_json("html", page)
            w.put_json("prompts", per_prompt)
            for name, png in pngs.items():
                w.write_array(name, np.frombuffer(png, dtype=np.uint8))
