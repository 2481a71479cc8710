"""Report pieces shared by the report stage and ``dfcache watch``: τ-by-step and histogram plots
(matplotlib, PNG bytes), token texts of blocks, and one self-contained HTML page.

The HTML page is static and self-contained (PNGs embedded as data URLs, no script, no network):
a summary table, the plots, and per-prompt views where each block of a completion is a span
coloured by its accepted length, with the length, root position and block number in its
``title`` (hover) and as a small superscript. Block roots are not stored: the walk defines them
(docs/metrics.md): the first root is the prompt length P, the next is p + value, and the block
rooted at p commits completion tokens p+1 … p+value (token P comes from the prefill).
"""

from __future__ import annotations

import base64
import codecs
import html
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence


def fmt(v, digits: int = 2) -> str:
    return "-" if v is None else f"{v:.{digits}f}"


# --------------------------------------------------------------------------------------------
# Token texts
# --------------------------------------------------------------------------------------------

def _byte_decoder() -> dict[str, int]:
    # The byte-level BPE alphabet (GPT-2, Qwen): every byte has one printable stand-in character.
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = list(bs)
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


class TokenText:
    """The text of consecutive token spans, read from a target's ``tokenizer.json`` (the
    ``tokenizers`` library: no torch, no transformers).

    Byte-level tokenizers are decoded exactly, byte by byte, with a multi-byte character that
    straddles two blocks shown in the block where it is completed. Others decode each span after
    a few tokens of context, so leading spaces survive.
    """

    def __init__(self, tokenizer, byte_level: bool, special: dict[int, str]) -> None:
        self._tok = tokenizer
        self._byte_level = byte_level
        self._special = special
        self._bytes: dict[int, bytes] = {}
        self._decoder = _byte_decoder() if byte_level else {}

    @classmethod
    def from_target(cls, target_dir: str | Path | None) -> "TokenText | None":
        if not target_dir:
            return None
        path = Path(target_dir) / "tokenizer.json"
        try:
            from tokenizers import Tokenizer

            tok = Tokenizer.from_file(str(path))
            spec = json.loads(path.read_text())
        except Exception:  # no tokenizer.json, or one this tokenizers version cannot read: show ids
            return None
        dec = spec.get("decoder") or {}
        kinds = {dec.get("type")} | {d.get("type") for d in dec.get("decoders", []) if isinstance(d, dict)}
        special = {int(t["id"]): t["content"] for t in spec.get("added_tokens", []) if "id" in t}
        return cls(tok, "ByteLevel" in kinds, special)

    def _token_bytes(self, i: int) -> bytes:
        b = self._bytes.get(i)
        if b is None:
            if i in self._special:
                b = self._special[i].encode()
            else:
                piece = self._tok.id_to_token(i)
                if piece is None:
                    b = f"[{i}]".encode()
                else:
                    b = b"".join(bytes([self._decoder[c]]) if c in self._decoder else c.encode() for c in piece)
            self._bytes[i] = b
        return b

    def spans(self, ids: Sequence[int], cuts: Sequence[int]) -> list[str]:
        """Texts of ``ids[cuts[k]:cuts[k+1]]`` for each k."""
        ids = [int(i) for i in ids]
        out = []
        if self._byte_level:
            dec = codecs.getincrementaldecoder("utf-8")(errors="replace")
            for a, b in zip(cuts, cuts[1:]):
                out.append(dec.decode(b"".join(self._token_bytes(i) for i in ids[a:b])))
            if out:
                out[-1] += dec.decode(b"", final=True)
            return out
        for a, b in zip(cuts, cuts[1:]):
            ctx = ids[max(0, a - 4):a]
            head = self._tok.decode(ctx, skip_special_tokens=False)
            full = self._tok.decode(ctx + ids[a:b], skip_special_tokens=False)
            out.append(full[len(head):] if full.startswith(head) else self._tok.decode(ids[a:b], skip_special_tokens=False))
        return out


# --------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------

def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def png(fig) -> bytes:
    plt = pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=110, bbox_inches="tight", metadata={"Software": None})
    plt.close(fig)
    return buf.getvalue()


@dataclass
class Point:
    """One evaluated drafter as the plots and tables see it."""

    label: str
    step: int | None
    tau_chain: float | None
    tau_tree: dict[str, float | None]
    histogram: list[int]
    key: str = ""


def tau_by_step_png(points: Sequence[Point], reference: Point | None, budgets: Sequence[int]) -> bytes:
    """τ chain and τ of each tree budget against the training step; the reference as
    horizontal dashed lines in the same colours. Checkpoints without a step are placed by order."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.2))
    stepped = all(p.step is not None for p in points)
    xs = [p.step if stepped else i for i, p in enumerate(points)]
    series = [("chain", lambda p: p.tau_chain)] + [(f"tree-{b}", lambda p, b=b: p.tau_tree.get(str(b)))
                                                   for b in budgets]
    colours = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i, (name, get) in enumerate(series):
        colour = colours[i % len(colours)]
        pts = [(x, get(p)) for x, p in zip(xs, points) if get(p) is not None]
        if pts:
            ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", color=colour, label=f"τ {name}")
        if reference is not None and get(reference) is not None:
            ax.axhline(get(reference), color=colour, linestyle="--", linewidth=1,
                       label=f"reference τ {name} ({fmt(get(reference))})")
    ax.set_xlabel("training step" if stepped else "checkpoint (in order)")
    ax.set_ylabel("τ (tokens per block)")
    ax.set_title("Acceptance by training step")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    return png(fig)


def histograms_png(series: Sequence[tuple[str, list[int]]], title: str = "Acceptance histogram (chain)") -> bytes:
    """Share of blocks by accepted length, the drafters' bars side by side."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4))
    n = len(series)
    width = 0.8 / max(n, 1)
    for i, (label, hist) in enumerate(series):
        values = hist[1:]
        total = sum(values) or 1
        xs = [x + 1 + (i - (n - 1) / 2) * width for x in range(len(values))]
        ax.bar(xs, [h / total for h in values], width=width, label=label)
    ax.set_xlabel("tokens accepted per block (incl. bonus)")
    ax.set_ylabel("share of blocks")
    ax.set_title(title)
    ax.legend(fontsize=8)
    return png(fig)


# --------------------------------------------------------------------------------------------
# Per-prompt view
# --------------------------------------------------------------------------------------------

def block_cuts(prompt_len: int, values: Sequence[int]) -> list[int]:
    """Absolute token positions delimiting what each block commits: block k commits
    ``tokens[cuts[k]:cuts[k+1]]``. cuts[0] = P + 1 (token P is the prefill's); root k = cuts[k] - 1."""
    cuts = [prompt_len + 1]
    for v in values:
        cuts.append(cuts[-1] + int(v))
    return cuts


def _colour(value: int, block_size: int) -> str:
    hue = 0 if block_size <= 1 else round(120 * (value - 1) / (block_size - 1))
    return f"hsl({hue},75%,82%)"


def _span(text: str, cls: str, title: str, style: str = "", badge: str = "") -> str:
    sup = f"<sup>{html.escape(badge)}</sup>" if badge else ""
    st = f' style="{style}"' if style else ""
    return f'<span class="{cls}" title="{html.escape(title, quote=True)}"{st}>{html.escape(text)}{sup}</span>'


def completion_html(seq: Sequence[int], prompt_len: int, completion_len: int, values: Sequence[int],
                    block_size: int, text: TokenText | None) -> str:
    """The completion with each block as a span coloured by its accepted length."""
    end = prompt_len + completion_len
    cuts = block_cuts(prompt_len, values)
    bounds = [prompt_len] + [min(c, end) for c in cuts]
    if bounds[-1] < end:
        bounds.append(end)  # tokens after the last evaluated block (--max-blocks)
    if text is not None:
        texts = text.spans(seq, bounds)
    else:
        texts = ["".join(f"[{int(t)}]" for t in seq[a:b]) for a, b in zip(bounds, bounds[1:])]
    parts = []
    for k, (a, b) in enumerate(zip(bounds, bounds[1:])):
        t = texts[k]
        if k == 0:
            parts.append(_span(t, "pre", f"position {a}: the first completion token, from the prefill (not a block)"))
        elif k - 1 < len(values):
            v = int(values[k - 1])
            parts.append(_span(t, f"blk a{v}", f"block {k}: root position {a - 1}, accepted length {v} "
                                               f"(of {block_size})", style=f"background:{_colour(v, block_size)}",
                               badge=str(v)))
        else:
            parts.append(_span(t, "tail", f"positions {a}…{b - 1}: not evaluated (beyond --max-blocks)"))
    return "".join(parts)


@dataclass
class DrafterView:
    """One drafter's per-prompt data: its eval's ``responses`` document and block size."""

    label: str
    responses: list[dict]
    block_size: int


def _mean(values) -> float | None:
    return sum(values) / len(values) if values else None


def per_prompt_html(views: Sequence[DrafterView], tokens, text: TokenText | None, budgets: Sequence[int],
                    anchor: str = "pp") -> str:
    """A per-prompt table (τ of each drafter per prompt), then each drafter's completions with
    their blocks, chain open and each tree budget folded."""
    if tokens is None or not views:
        return "<p>No per-prompt data.</p>"
    index = {sid: i for i, sid in enumerate(tokens.sample_ids)}
    out = ['<table class="pp-table"><thead><tr><th>prompt</th><th>tokens</th>']
    out += [f"<th>{html.escape(v.label)}<br>τ chain</th>" for v in views]
    out.append("</tr></thead><tbody>")
    by_id = [{r["id"]: r for r in v.responses} for v in views]
    for sid in [r["id"] for r in views[0].responses]:
        r0 = by_id[0][sid]
        out.append(f'<tr><td><a href="#{anchor}-0-{html.escape(sid)}">{html.escape(sid)}</a></td>'
                   f'<td>{r0["completion_len"]}</td>')
        out += [f"<td>{fmt(_mean(m[sid]['chain'])) if sid in m else '-'}</td>" for m in by_id]
        out.append("</tr>")
    out.append("</tbody></table>")
    for vi, view in enumerate(views):
        out.append(f'<section class="per-prompt" data-drafter="{html.escape(view.label, quote=True)}">'
                   f"<h3>{html.escape(view.label)}: per prompt</h3>")
        for r in view.responses:
            i = index.get(r["id"])
            if i is None:
                continue
            seq = tokens.sample(i)
            plen = int(r["prompt_len"])
            sid = html.escape(r["id"])
            prompt_text = text.spans(seq, [0, plen])[0] if text is not None else " ".join(map(str, seq[:plen]))
            out.append(f'<article class="prompt" id="{anchor}-{vi}-{sid}"><h4>{sid}: τ chain '
                       f'{fmt(_mean(r["chain"]))}, {len(r["chain"])} blocks, {r["completion_len"]} tokens'
                       f'{", ended by a stop token" if r.get("ended_by_stop") else ""}</h4>'
                       f'<details><summary>prompt ({plen} tokens)</summary><pre>{html.escape(prompt_text)}</pre>'
                       "</details>")
            methods = [("chain", r["chain"])] + [(f"tree-{b}", r.get("tree", {}).get(str(b))) for b in budgets]
            for mi, (name, values) in enumerate(methods):
                if values is None:
                    continue
                body = completion_html(seq, plen, int(r["completion_len"]), values, view.block_size, text)
                out.append(f'<details class="method"{" open" if mi == 0 else ""}><summary>{name}: '
                           f"τ {fmt(_mean(values))} over {len(values)} blocks</summary>"
                           f'<div class="completion">{body}</div></details>')
            out.append("</article>")
        out.append("</section>")
    return "\n".join(out)


# --------------------------------------------------------------------------------------------
# The page
# --------------------------------------------------------------------------------------------

_CSS = """
body{font:14px/1.45 system-ui,-apple-system,Segoe UI,sans-serif;margin:24px auto;max-width:1100px;color:#222;padding:0 16px}
h1{font-size:22px;margin-bottom:4px} .sub{color:#666;margin-top:0}
table{border-collapse:collapse;margin:8px 0 16px} th,td{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3} td:first-child,th:first-child,td.l{text-align:left}
tr.reference td{background:#eef4ff} tr.best td{font-weight:600} tr.latest td:first-child::after{content:" (latest)";color:#888;font-weight:400}
.warn{background:#fff3cd;border:1px solid #e0c36a;padding:6px 10px}
figure{display:inline-block;margin:0 12px 12px 0} figure img{max-width:520px;border:1px solid #ddd}
.completion{white-space:pre-wrap;font:13px/1.7 ui-monospace,Menlo,Consolas,monospace;border:1px solid #ddd;padding:8px;background:#fcfcfc}
.completion span{border-radius:3px;padding:1px 0} .completion span.blk{box-shadow:inset -1px 0 0 #999}
.completion sup{font-size:9px;color:#555;margin-left:1px} .pre,.tail{background:#e4e4e4;color:#555}
article.prompt{margin:10px 0 18px} article.prompt h4{margin:6px 0} details.method summary{cursor:pointer;color:#345}
.legend span{display:inline-block;padding:1px 7px;margin-right:2px;border-radius:3px;font:12px ui-monospace,monospace}
pre{white-space:pre-wrap;background:#f6f6f6;padding:6px}
table{display:block;max-width:100%;overflow-x:auto}
.completion,pre,td.l,h1,h2,h3,h4,p,figcaption{overflow-wrap:anywhere}
figure{max-width:100%} figure img{max-width:min(520px,100%);height:auto}
"""
# The last three lines keep the page inside the window (it scrolled sideways at 1400 px): a table
# wider than the page (many drafters, checkpoints or tree budgets) scrolls inside itself, and long
# unbroken text (ids, keys, paths, a completion without spaces) wraps instead of widening the page.


def legend_html(block_size: int) -> str:
    cells = "".join(f'<span style="background:{_colour(v, block_size)}">{v}</span>' for v in range(1, block_size + 1))
    return (f'<p class="legend">accepted length per block: {cells} '
            '<span class="pre">prefill / not evaluated</span> (hover a block for its root and length)</p>')


def _numeric(cell) -> bool:
    try:
        float(str(cell))
    except ValueError:
        return str(cell) == "-"
    return True


def table_html(headers: Sequence[str], rows: Sequence[tuple[str, Sequence[str]]], table_id: str = "summary") -> str:
    """``rows``: (css class, cells)."""
    out = [f'<table id="{table_id}"><thead><tr>' + "".join(f"<th>{html.escape(h)}</th>" for h in headers)
           + "</tr></thead><tbody>"]
    for cls, cells in rows:
        out.append(f'<tr class="{cls}">' + "".join(
            f'<td{"" if _numeric(c) else " class=l"}>{html.escape(str(c))}</td>' for c in cells) + "</tr>")
    out.append("</tbody></table>")
    return "\n".join(out)


def page(*, title: str, subtitle: str, table: str, images: Sequence[tuple[str, bytes]], sections: Sequence[str],
         warnings: Sequence[str] = ()) -> str:
    imgs = "".join(f'<figure><img alt="{html.escape(cap, quote=True)}" src="data:image/png;base64,'
                   f'{base64.b64encode(png).decode()}"><figcaption>{html.escape(cap)}</figcaption></figure>'
                   for cap, png in images)
    warn = "".join(f'<p class="warn">{html.escape(w)}</p>' for w in warnings)
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>{html.escape(title)}</title><style>{_CSS}</style></head><body>"
            f"<h1>{html.escape(title)}</h1><p class=\"sub\">{html.escape(subtitle)}</p>{warn}"
            f"<h2>Summary</h2>{table}<h2>Plots</h2><div class=\"plots\">{imgs}</div>"
            + "".join(sections) + "</body></html>\n")
