"""Stage `report`: the drafters side by side — JSON, a markdown table and PNG plots.

Key recipe (a set-level artifact: the one stage whose key depends on the set and its order)::

    key = xxh3_128(canonical({stage: "report", stage_version: VERSION,
        inputs: {drafters: [display names, in --drafter order]},
        upstream: {evals: [set key of each drafter_eval node, same order]}}))

where a node's set key is ``xxh3_128(canonical({"partition": P, "set": xxh3_128(",".join(sample
keys in prompt order))}))``. The manifest's ``sample_refs`` name the eval samples it was made
from (``gc`` keeps them). A run whose report is stored (here or in a remote) needs nothing else.

Output: documents ``report`` (the JSON documented in docs/metrics.md) and ``markdown``; uint8
arrays ``png_histogram`` and ``png_position`` (PNG bytes). The files are materialized under
``<store>/reports/<key[:12]>/`` when a run prints them, so a cached run shows them by path
without re-plotting (and without importing matplotlib or torch).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from dfcache.cli._common import emit_json

from ..graph import Node, RunContext

NAME = "report"
VERSION = 2

FILES = {"report.json": "report", "report.md": "markdown", "histogram.png": "png_histogram",
         "acceptance_by_position.png": "png_position"}


def build(ctx: RunContext, evals: list[Node]) -> Node:
    names = [e.payload["drafter"].name for e in evals]
    return Node.make(NAME, VERSION, inputs={"drafters": names}, upstream={"evals": [e.key for e in evals]},
                     needs="cpu", deps=list(evals), label="report",
                     summary="report: " + " vs ".join(names))


def _fmt(v, digits=2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def make_report(summaries: list[dict], keys: list[str]) -> dict:
    drafters = []
    for s, key in zip(summaries, keys):
        chain = s["chain"]
        drafters.append({
            "drafter": s["drafter"], "key": key,
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
    return {"end_rule": rule, "drafters": drafters, "warnings": warnings}


def markdown_table(report: dict) -> str:
    budgets = sorted({int(b) for d in report["drafters"] for b in d["tau_tree"]})
    head = ["drafter", "τ chain"] + [f"τ tree-{b}" for b in budgets] + ["blocks", "tokens/block",
                                                                         "responses", "states"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for d in report["drafters"]:
        hs = d["hidden_states_backend"]
        states = f"{hs['kernel']}/{hs['device']}/{hs['dtype']}" + (" ⚠ trained on " + d["trained_on"]
                                                                   if d["backend_mismatch"] else "")
        row = [d["drafter"], _fmt(d["tau_chain"])] + [_fmt(d["tau_tree"].get(str(b))) for b in budgets] + \
              [str(d["blocks"]), _fmt(d["tokens_per_block"]), str(d["responses"]), states]
        lines.append("| " + " | ".join(row) + " |")
    text = "\n".join(lines)
    if report["warnings"]:
        text += "\n\n" + "\n".join(f"**{w}**" for w in report["warnings"])
    text += (f"\n\nEnd rule: {report['end_rule']} (each block capped at the completion tokens left after "
             "its root; see docs/metrics.md).")
    return text


def _plots(report: dict) -> tuple[bytes, bytes]:
    import io

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def png(fig) -> bytes:
        buf = io.BytesIO()
        fig.savefig(buf, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
        plt.close(fig)
        return buf.getvalue()

    fig, ax = plt.subplots(figsize=(7, 4))
    n = len(report["drafters"])
    width = 0.8 / max(n, 1)
    for i, d in enumerate(report["drafters"]):
        hist = d["histogram"][1:]
        total = sum(hist) or 1
        xs = [x + 1 + (i - (n - 1) / 2) * width for x in range(len(hist))]
        ax.bar(xs, [h / total for h in hist], width=width, label=f"{d['drafter']} (τ={_fmt(d['tau_chain'])})")
    ax.set_xlabel("tokens accepted per block (chain, incl. bonus)")
    ax.set_ylabel("share of blocks")
    ax.set_title("Acceptance histogram")
    ax.legend()
    hist_png = png(fig)
    fig, ax = plt.subplots(figsize=(7, 4))
    for d in report["drafters"]:
        rates = d["accept_rate_at"]
        ax.plot(range(1, len(rates) + 1), rates, marker="o", label=d["drafter"])
    ax.set_xlabel("draft position j")
    ax.set_ylabel("P(first j drafts accepted)")
    ax.set_ylim(0, 1.02)
    ax.set_title("Acceptance by position (chain)")
    ax.legend()
    return hist_png, png(fig)


def produce(ctx: RunContext, nodes: list[Node]) -> None:
    import numpy as np

    from .drafter_eval import summarize_node

    for node in nodes:
        evals = node.deps
        report = make_report([summarize_node(ctx.store, e) for e in evals], [e.key for e in evals])
        hist_png, pos_png = _plots(report)
        refs = [{"partition": e.partition.key, "keys": list(dict.fromkeys(e.sample_keys))} for e in evals]
        with ctx.store.writer(node.key, stage=NAME, stage_version=VERSION, inputs=node.inputs,
                              upstream=node.upstream, summary=node.summary, sample_refs=refs) as w:
            w.put_json("report", report)
            w.put_json("markdown", markdown_table(report))
            w.write_array("png_histogram", np.frombuffer(hist_png, dtype=np.uint8))
            w.write_array("png_position", np.frombuffer(pos_png, dtype=np.uint8))


def materialize(store, key: str) -> dict[str, Path]:
    """Write the report's files under <store>/reports/<key[:12]>/ (once) and return their paths."""
    art = store.open(key)
    root = getattr(store.backend, "root", None)
    if root is None:
        return {}
    out = Path(root) / "reports" / key[:12]
    paths = {}
    for filename, name in FILES.items():
        path = out / filename
        paths[filename] = path
        if path.exists():
            continue
        out.mkdir(parents=True, exist_ok=True)
        if name in art.manifest.blobs:
            doc = art.json(name)
            data = (doc if isinstance(doc, str) else json.dumps(doc, indent=1)).encode() + b"\n"
        else:
            data = art.array(name).read().tobytes()
        tmp = path.with_name(f".{filename}.{os.getpid()}.tmp")
        tmp.write_bytes(data)
        os.replace(tmp, path)
    return paths


def stage_counts(nodes: list[Node]) -> list[dict]:
    """Per node of a run: status and, per-sample, how many samples were reused, pulled, produced."""
    out = []
    for n in nodes:
        row = {"stage": n.stage, "label": n.label or n.stage, "key": n.key, "status": n.status}
        if n.partition is not None:
            c = n.samples_dict()
            row["samples"] = {"total": c["total"], "reused": c["cached"], "pulled": c["pulled"],
                              "computed": c["produced"], "not_needed": c["total"] - c["cached"] - len(n.pull)
                              - len(n.produce)}
        out.append(row)
    return out


def print_result(ctx: RunContext, node: Node, *, elapsed: float, nodes: list[Node] | None = None) -> None:
    art = ctx.store.open(node.key)
    report = art.json("report")
    paths = materialize(ctx.store, node.key)
    computed = len(ctx.work_done)
    if ctx.options.json:
        emit_json({**report, "report_key": node.key, "files": {k: str(v) for k, v in paths.items()},
                   "computed": ctx.work_done, "stages": stage_counts(nodes or []),
                   "seconds": round(elapsed, 3)})
        return
    for w in report["warnings"]:
        print(f"\n!!! {w}\n")
    print(art.json("markdown"))
    print()
    for name, path in paths.items():
        print(f"{name:<28} {path}")
    print()
    for row in stage_counts(nodes or []):
        if "samples" in row:
            s = row["samples"]
            print(f"{row['label']:<28} {s['reused']} reused, {s['pulled']} pulled, {s['computed']} computed"
                  f" of {s['total']} samples")
    print(f"\n{computed} node(s) did work, the rest from the cache; {elapsed:.1f} s.")
