"""A stored report as a run shows it: the stored facts plus the verdicts of this run's options.

The report stage stores facts only: numbers, the selection they were made from (target, prompts,
completions, hidden states, drafters as declared), and per row where its completion ids came
from. Verdicts that depend on options outside the key are decided here, each time results are
shown (DESIGN.md, trust rules), never stored:

* ``--trained-on fla|torch``: the backend the drafters were trained on, else what each
  checkpoint declares (``dflash_config.trained_on_backend``, covered by its fingerprint). A
  drafter evaluated on states of another kernel family gets a warning and a marked row.
* ``--accept-retokenized``: a report whose rows use completions whose ids were rebuilt from text
  and failed their check (``retokenized, unverified (accepted)``) is refused without it (exit 6),
  shown with a banner with it.

The files under ``<store>/reports/<key[:12]>/`` are written here too: the PNGs once (facts),
``report.json``, ``report.md`` and ``report.html`` whenever this run's verdicts differ from those
they were written for (a stamp, ``.shown.json``, written after them and compared first, so a
fully cached run that shows what the files already say reads one small file and writes nothing).

Standard library only (and runner.core.completion_source): a fully cached ``run eval`` is answered
through here by runner/commands/fast_run.py, which must not import numpy, torch or typer.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

from dfcache.errors import BadInputError

from . import completion_source as cs

# Where the stored report.html leaves room for what is decided when it is shown (the banner,
# the warnings and the summary table, whose rows mark a backend mismatch).
SHOW_MARK = "<!--dfcache:shown-->"
STAMP = ".shown.json"  # in the report's directory: the verdicts its files were written for

FILES = {"report.json": "report", "report.md": "markdown", "histogram.png": "png_histogram",
         "acceptance_by_position.png": "png_position", "tau_by_step.png": "png_tau_by_step",
         "report.html": "html"}

LEGEND = ("τ chain = mean over responses of each response's mean tokens per block (accepted + bonus); "
          "tokens/block = all tokens / all blocks, pooled, so τ can exceed it; τ tree-N = τ with a DDTree "
          "of N drafted nodes, which at a small N can be below the chain.")

_MEANING = {  # what each label means for τ (docs/metrics.md "Where completions come from")
    cs.VERIFIED: "ids rebuilt from the server's text; their count matched the server's and they decode back "
                 "to the text, but they may still differ from the ids the target generated (another "
                 "tokenization of the same text)",
    cs.ACCEPTED: "ids rebuilt from the server's text failed that check and were kept by "
                 "--accept-retokenized: τ over them may say nothing about real decoding",
    cs.UNCHECKED: "ids rebuilt from the server's text and cached before dfcache checked such ids: as uncertain "
                  "as unverified ones",
    cs.IMPORTED: "ids imported from a peer's files (dfcache import): whatever produced them, not a "
                 "generation dfcache recorded",
}
IDS_FIX = ("take completions whose ids come from the target itself: --server-api sglang (its native "
           "/generate returns them), a vLLM server (asked for its ids), or --completions local")


def _fmt(v, digits=2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


def sources_text(counts: dict[str, int]) -> str:
    """``server ids`` when every sample has one label, else ``8 server ids; 2 retokenized, verified``
    (labels hold commas, so counts are separated by semicolons), in the order of LABELS."""
    present = [(label, counts[label]) for label in cs.LABELS if counts.get(label)]
    present += [(label, n) for label, n in counts.items() if label not in cs.LABELS and n]
    if len(present) == 1:
        return present[0][0]
    return "; ".join(f"{n} {label}" for label, n in present) or "-"


def not_exact(counts: dict[str, int]) -> dict[str, int]:
    return {label: n for label, n in counts.items() if n and label not in cs.EXACT}


# --------------------------------------------------------------------------------------------
# Verdicts
# --------------------------------------------------------------------------------------------

def view(doc: dict, *, trained_on: str | None = None, accept_retokenized: bool = False,
         key: str | None = None) -> dict:
    """The stored report ``doc`` with this run's verdicts: per row ``trained_on`` (the run's view),
    ``trained_on_source`` and ``backend_mismatch``; ``warnings``, ``banner`` and ``verdicts``.

    Raises BadInputError (exit 6) when rows use completions whose ids failed their check and
    ``accept_retokenized`` is not given."""
    refuse_unaccepted(doc, accept_retokenized=accept_retokenized, key=key)
    drafters = []
    for d in doc["drafters"]:
        declared = d.get("trained_on_declared")
        effective = trained_on or declared
        kernel = (d.get("hidden_states_backend") or {}).get("kernel")
        drafters.append({**d, "trained_on": effective,
                         "trained_on_source": "--trained-on" if trained_on else ("declared" if declared else None),
                         "backend_mismatch": bool(effective and kernel and effective != kernel)})
    warnings = [
        f"WARNING: drafter {d['drafter']} was trained on {d['trained_on']} hidden states "
        f"({'--trained-on' if d['trained_on_source'] == '--trained-on' else 'as its config declares'}) but is "
        f"evaluated on {d['hidden_states_backend']['kernel']} states ({d['hidden_states_backend']['device']}); "
        "its acceptance here may say nothing about real decoding. Extract with --backend "
        f"{d['trained_on']} to compare like with like."
        for d in drafters if d["backend_mismatch"]]
    return {**doc, "drafters": drafters, "warnings": warnings, "banner": banner(doc),
            "verdicts": {"trained_on": trained_on, "accept_retokenized": bool(accept_retokenized)}}


def _all_sources(doc: dict) -> dict[str, int]:
    comp = (doc.get("selection") or {}).get("completions") or {}
    if comp.get("ids"):
        return dict(comp["ids"])
    total: dict[str, int] = {}
    for d in doc.get("drafters", []):
        for label, n in (d.get("completion_sources") or {}).items():
            total[label] = max(total.get(label, 0), n)
    return total


def refuse_unaccepted(doc: dict, *, accept_retokenized: bool, key: str | None = None) -> None:
    counts = _all_sources(doc)
    n = counts.get(cs.ACCEPTED, 0)
    if not n or accept_retokenized:
        return
    comp = (doc.get("selection") or {}).get("completions") or {}
    ids = list((comp.get("not_exact") or {}).get(cs.ACCEPTED) or [])
    named = ""
    if ids:
        more = f" and {n - len(ids)} more" if n > len(ids) else ""
        named = f" (prompt ids {', '.join(map(repr, ids))}{more})"
    what = f"report {key[:12]}" if key else "this report"
    raise BadInputError(
        f"{what} uses {n} completion(s){named} whose token ids were rebuilt from the server's text and failed "
        "their check (count against the server's usage, or the decode round trip), so its τ may say nothing "
        "about real decoding. Pass --accept-retokenized to show it anyway (marked in every row), or "
        f"{IDS_FIX}.")


def banner(doc: dict) -> list[str]:
    """Lines above the table when any row's completion ids are not exact (server ids, local greedy)."""
    lines = []
    for d in doc.get("drafters", []):
        bad = not_exact(d.get("completion_sources") or {})
        if bad:
            lines.append(f"drafter {d['drafter']}: completions {sources_text(d['completion_sources'])}")
    if not lines:
        return []
    labels = sorted({label for d in doc.get("drafters", []) for label in not_exact(d.get("completion_sources") or {})},
                    key=lambda x: cs.LABELS.index(x) if x in cs.LABELS else len(cs.LABELS))
    head = ("NOTE: not every completion's token ids are the ids the target generated, so τ may differ from "
            "real decoding.")
    return [head, *lines, *(f"{label}: {_MEANING.get(label, 'see docs/metrics.md')}." for label in labels),
            f"To be exact, {IDS_FIX} (docs/metrics.md, \"Where completions come from\")."]


# --------------------------------------------------------------------------------------------
# Table, markdown, HTML head
# --------------------------------------------------------------------------------------------

def table(report: dict) -> tuple[list[str], list[list[str]]]:
    """The summary table's header and rows (the markdown and the HTML show the same)."""
    budgets = sorted({int(b) for d in report["drafters"] for b in d["tau_tree"]})
    stepped = any(d.get("step") is not None for d in report["drafters"])
    eagle = sorted({k for d in report["drafters"] for k in d.get("tau_eagle_tree", {})})
    head = (["step"] if stepped else []) + ["drafter", "family", "τ chain"] + [f"τ tree-{b}" for b in budgets] + \
        [f"τ {k}" for k in eagle] + ["blocks", "tokens/block", "responses", "states", "completions"]
    rows = []
    for d in report["drafters"]:
        hs = d["hidden_states_backend"]
        states = f"{hs['kernel']}/{hs['device']}/{hs['dtype']}" + (" ⚠ trained on " + d["trained_on"]
                                                                   if d.get("backend_mismatch") else "")
        sources = d.get("completion_sources") or {}
        comp = sources_text(sources) + (" ⚠" if not_exact(sources) else "")
        step = [] if not stepped else ["-" if d.get("step") is None else str(d["step"])]
        rows.append(step + [d["drafter"], d.get("family", "dflash"), _fmt(d["tau_chain"])]
                    + [_fmt(d["tau_tree"].get(str(b))) for b in budgets]
                    + [_fmt(d.get("tau_eagle_tree", {}).get(k)) for k in eagle]
                    + [str(d["blocks"]), _fmt(d["tokens_per_block"]), str(d["responses"]), states, comp])
    return head, rows


def row_classes(report: dict) -> list[str]:
    """The HTML rows' classes: ``best`` (highest τ chain), ``latest`` (highest step)."""
    drafters = report["drafters"]
    best = max(range(len(drafters)), key=lambda i: drafters[i]["tau_chain"] or 0) if drafters else None
    stepped = [i for i, d in enumerate(drafters) if d.get("step") is not None]
    latest = max(stepped, key=lambda i: drafters[i]["step"]) if stepped else None
    return [" ".join(c for c, hit in (("best", i == best), ("latest", i == latest)) if hit)
            for i in range(len(drafters))]


def selection_lines(report: dict) -> list[str]:
    """The selection in a few lines of text (markdown list items without the bullet)."""
    sel = report.get("selection")
    if not sel:
        return []
    t, p, c, h, e = (sel.get(k) or {} for k in ("target", "prompts", "completions", "hidden_states", "eval"))

    def short(v):
        return "-" if v is None else (v[:12] if isinstance(v, str) and len(v) == 32 else str(v))

    if c.get("source") == "local":
        b = c.get("backend") or {}
        source = "local greedy" + (f" ({b.get('kernel')}/{b.get('device')}/{b.get('dtype')}/"
                                   f"{b.get('attn_implementation')})" if b else "")
    else:
        server = c.get("server")
        source = f"{c.get('source')} server" + (f" {_join(server)}" if server else "") + \
            (f", served model {_join(c.get('served_model'))}" if c.get("served_model") else "")
    hb = h.get("backend") or {}
    versions = h.get("versions") or {}
    lines = [
        f"target: {t.get('name') or t.get('path')} (fingerprint {short(t.get('fingerprint'))}, revision "
        f"{t.get('revision') or '-'}; {t.get('path')})",
        f"prompts: {p.get('source')} ×{p.get('count')} (digest {short(p.get('digest'))})",
        f"completions: {source}; ids {sources_text(c.get('ids') or {})}; temperature {c.get('temperature')}, "
        f"top_p {c.get('top_p')}, seed {'-' if c.get('seed') is None else c['seed']}, max {c.get('max_new_tokens')} new tokens, thinking "
        f"{'on' if c.get('enable_thinking') else 'off'}, chat template {short(c.get('chat_template'))}",
        f"hidden states: {hb.get('kernel')}/{hb.get('device')}/{hb.get('dtype')}/{hb.get('attn_implementation')}"
        f"{' stored ' + hb['states'] + ' (lossy)' if hb.get('states') else ''}, "
        f"layers {h.get('layers')}" + (f", {h['model_class']}" if h.get("model_class") else "")
        + ("; " + ", ".join(f"{k} {_join(v)}" for k, v in sorted(versions.items())) if versions else ""),
        f"eval: end rule {e.get('end_rule')}, tree budgets {e.get('tree_budgets') or '-'}, max blocks "
        f"{e.get('max_blocks') if e.get('max_blocks') is not None else '-'}, {e.get('dtype')} on {e.get('device')}; "
        f"dfcache {sel.get('dfcache_version')}",
    ]
    for d in report["drafters"]:
        lines.append(f"drafter {d['drafter']}: {d.get('path')} (fingerprint {short(d.get('fingerprint'))}, step "
                     f"{d.get('step') if d.get('step') is not None else '-'}, block size {d.get('block_size')}, "
                     f"layers {d.get('target_layer_ids')}, trained on {d.get('trained_on_declared') or '-'} as "
                     "declared)")
    return lines


def _join(v) -> str:
    return ", ".join(map(str, v)) if isinstance(v, list) else str(v)


def markdown(report: dict, sections: "ShownSections | None" = None) -> str:
    """The report as markdown: banner and warnings (when shown), the table, the legend, the selection,
    then ``sections`` (the tables per prompt set, when shown)."""
    head, rows = table(report)
    parts = []
    if report.get("banner"):
        parts.append("\n".join(f"> {'**' + b + '**' if i == 0 else b}  " for i, b in enumerate(report["banner"])))
    if report.get("warnings"):
        parts.append("\n".join(f"**{w}**" for w in report["warnings"]))
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    parts.append("\n".join(lines))
    parts.append(LEGEND)
    parts.append(f"End rule: {report['end_rule']} (each block capped at the completion tokens left after its root; "
                 "see docs/metrics.md).")
    sel = selection_lines(report)
    if sel:
        parts.append("Selection:\n" + "\n".join(f"- {line}" for line in sel))
    if sections is not None:
        parts.append(sections.markdown)
    return "\n\n".join(parts)


@dataclass(frozen=True)
class ShownSections:
    """What a run adds to its report when it shows it, from options outside the report's key
    (runner/suites/tables.py: τ per prompt set, per turn, the --mix row): put into report.json
    (under ``key``), report.md and report.html, and into the stamp, since they change with the run."""

    key: str
    doc: dict
    markdown: str
    html: str

    def digest(self) -> str:
        import hashlib

        return hashlib.sha256((self.markdown + "\0" + self.html).encode()).hexdigest()[:16]


def shown_html(report: dict, sections: ShownSections | None = None) -> str:
    """What replaces SHOW_MARK in the stored page: banner, warnings, the summary table (and the
    tables per prompt set after it, when shown)."""
    import html  # here: a cached run whose files are up to date writes no HTML

    from .reporting import table_html  # standard library only, as here

    head, rows = table(report)
    banner_html = ""
    if report.get("banner"):
        first, *rest = report["banner"]
        banner_html = (f'<div class="warn banner"><p><strong>{html.escape(first)}</strong></p>'
                       + "".join(f"<p>{html.escape(x)}</p>" for x in rest) + "</div>")
    warn = "".join(f'<p class="warn">{html.escape(w)}</p>' for w in report.get("warnings", []))
    return banner_html + warn + table_html(head, list(zip(row_classes(report), rows))) + (
        sections.html if sections is not None else "")


# --------------------------------------------------------------------------------------------
# Showing a stored report
# --------------------------------------------------------------------------------------------

def show(store, key: str, opts, sections: ShownSections | None = None) -> tuple[dict, str, dict[str, Path]]:
    """The report ``key`` as this run shows it: (report with verdicts, markdown, materialized files);
    ``sections``: the run's tables per prompt set, added to all three."""
    art = store.open(key)
    shown = view(art.json("report"), trained_on=getattr(opts, "trained_on", None),
                 accept_retokenized=bool(getattr(opts, "accept_retokenized", False)), key=key)
    if sections is not None:
        shown[sections.key] = sections.doc
    return shown, markdown(shown, sections), materialize(store, key, shown, art=art, sections=sections)


def materialize(store, key: str, shown: dict, art=None, sections: ShownSections | None = None) -> dict[str, Path]:
    """Write the report's files under <store>/reports/<key[:12]>/ as ``shown`` says, and return their
    paths. PNGs are written once; report.html, report.md and report.json whenever the verdicts and
    sections they were written for (the stamp ``.shown.json``, written last) are not this run's."""
    reports = store.local_dir("reports")
    if reports is None:
        return {}
    art = art if art is not None else store.open(key)
    m = art.manifest
    out = reports / key[:12]
    paths = {filename: out / filename for filename, name in FILES.items()
             if name in m.blobs or name in m.arrays}  # e.g. no tau_by_step.png without steps
    # What the files depend on besides the stored report (fixed by its key): the verdicts. Comparing
    # this stamp, not the files, keeps a cached run that changes nothing at one small read (the
    # indented report.json costs more to encode than the rest of showing it; docs/benchmarks.md noop-eval).
    stamp_path = out / STAMP
    stamp = json.dumps({"report_key": key, "verdicts": shown["verdicts"], "files": sorted(paths),
                        "sections": sections.digest() if sections is not None else None}, sort_keys=True)
    try:
        if stamp_path.read_text() == stamp and all(p.exists() for p in paths.values()):
            return paths
    except OSError:
        pass
    out.mkdir(parents=True, exist_ok=True)
    for filename, path in paths.items():
        name = FILES[filename]
        if name in m.arrays:
            if not path.exists():
                _write(path, art.array(name).read().tobytes())
        elif filename == "report.html":
            page = art.json(name)
            _write(path, page.replace(SHOW_MARK, shown_html(shown, sections), 1).encode())
        elif filename == "report.md":
            _write(path, (markdown(shown, sections) + "\n").encode())
    doc = {**shown, "report_key": key, "files": {k: str(v) for k, v in paths.items()}}
    _write(paths["report.json"], json.dumps(doc, indent=1, ensure_ascii=False).encode() + b"\n")
    _write(stamp_path, stamp.encode())  # last: the files above are this view's
    return paths


def _write(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)
