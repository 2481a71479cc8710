"""`dfcache show KEY`: one artifact's manifest and what it was made from (its upstream chain,
dfcache.maintenance.upstream_chain)."""

from __future__ import annotations

import typer

from ..fp8 import FP8_DTYPE, FP8_E4M3, hidden_width
from ..maintenance import backend_summary, upstream_chain
from .common import KeyArg, emit_json, examples, get_store, human_bytes, state

EPILOG = examples("dfcache show 3f2a9c1e", "dfcache --json show 3f2a9c1e | jq .upstream_chain")


def show(key: KeyArg) -> None:
    """Show one artifact's manifest and its upstream chain."""
    store = get_store(create=False)
    m = store.manifest(store.resolve(key))
    chain = upstream_chain(store, m)
    if state.json:
        emit_json({**m.to_dict(), "backend": m.backend, "upstream_chain": chain})
        return
    print(f"key:          {m.key}")
    print(f"stage:        {m.stage} (version {m.stage_version})")
    print(f"created:      {m.created}  by dfcache {m.dfcache_version}")
    print(f"size:         {human_bytes(m.size_bytes)}")
    if m.summary:
        print(f"summary:      {m.summary}")
    if m.backend:
        print(f"backend:      {backend_summary(m)}")
    print("inputs:")
    for k, v in sorted(m.inputs.items()):
        print(f"  {k}: {v}")
    print("provenance:")
    for k, v in sorted(m.provenance.items()):
        print(f"  {k}: {v}")
    print("arrays:")
    for name, a in sorted(m.arrays.items()):
        codec = a.codec if a.dtype != FP8_DTYPE else f"{FP8_E4M3}+{a.codec}" if a.codec != "none" else FP8_E4M3
        what = (f"{FP8_DTYPE} {a.shape} (bf16 rows of {hidden_width(a.shape[1])} as FP8 codes and a float32 scale "
                f"per row)" if a.dtype == FP8_DTYPE else f"{a.dtype} {a.shape}")
        print(f"  {name}: {what} chunks of {a.chunk_rows} rows, codec {codec}, "
              f"{human_bytes(a.nbytes)}, digest {a.digest[:12]}")
    if m.blobs:
        print("documents: " + ", ".join(sorted(m.blobs)))
    print("upstream chain:")
    if not chain:
        print("  (none)")
    for c in chain:
        print(_chain_line(c))


def _chain_line(c: dict) -> str:
    """One entry of the upstream chain: an artifact, or the samples of a partition."""
    indent = "  " * c["depth"]
    if c.get("kind") != "samples":
        mark = "" if c["present"] else "  (not in this store)"
        return f"{indent}{c['key'][:12]} {c['stage'] or '?'}{mark}"
    n = c["samples"]
    segs = ", ".join(s[:12] for s in c["segments"][:3]) + (", ..." if len(c["segments"]) > 3 else "")
    where = f" in segment(s) {segs}" if segs else ""
    mark = "" if c["present"] else f"  ({n['needed'] - n['present']} not in this store)"
    what = f": {c['summary']}" if c["summary"] else ""
    return (f"{indent}{c['stage'] or '?'} partition {c['key'][:12]}, {n['present']} of {n['needed']} "
            f"sample(s){where}{mark}{what}")


def register(app: typer.Typer) -> None:
    app.command("show", epilog=EPILOG)(show)
