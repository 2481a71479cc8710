"""`dfcache plan --estimate`: what the planned hidden-state extraction will cost, before it starts.

For each hidden-states group of the plan (one target, backend class and tokens set): the samples
still to extract, their tokens (exact where the tokens are stored; else an upper bound from the
prompts' characters and ``--max-new-tokens``), the bytes they take per codec, and the hours at
the extraction rate of

1. the last extraction of a target of the same shape (attention kinds, hidden size, depth, dtype) that
   this store recorded (``<store>/extract-rates/rates.json``, written by the
   hidden-states stage after every extraction), preferring this machine's GPU; else
2. the GPU bench's figure for that shape (:data:`BENCH_RATES`, from ``bench/results/gpu/``).

A rate measured with the deepest layer at d is scaled by (d + 1) / (deepest + 1): the forward
stops after the deepest requested layer, and its cost grows with the layers it runs. Nothing here
imports torch or reads a tensor: sample docs (token counts) and config.json only.
"""

from __future__ import annotations

from pathlib import Path

from .extract_rates import read_rates, shape_key

# Bytes a token of a stored layer takes with each codec, relative to none: the `size` bench row on
# the tiny Qwen3.5 target's states (bench/results/cpu/size_read_2026-12-05-pm.json). Real models'
# states differ; the first extraction's own sizes are the figure to trust.
CODEC_RATIO = {"none": 1.0, "bitshuffle-lz4": 1 / 1.61, "shuffle-zstd": 1 / 1.94, "zstd": 1 / 1.41}

# The GPU bench's extraction rates (tokens/s through the real stage, fla, bf16, equal lengths).
BENCH_RATES = [
    {"hybrid": True, "hidden_size": 5120, "num_layers": 64, "dtype": "bfloat16", "deepest": 61,
     "gpu": "NVIDIA H100 80GB HBM3", "tok_per_s": 8077.0,
     "source": "bench/results/gpu/gpu_extract_27b_h100_2026-12-06.json"},
    {"hybrid": True, "hidden_size": 4096, "num_layers": 36, "dtype": "bfloat16", "deepest": 33,
     "gpu": "NVIDIA H200", "tok_per_s": 17737.5, "source": "bench/results/gpu/gpu_extract_8b_256_2026-12-04.json"},
    {"hybrid": True, "hidden_size": 2048, "num_layers": 16, "dtype": "bfloat16", "deepest": 13,
     "gpu": "NVIDIA H200", "tok_per_s": 86374.8, "source": "bench/results/gpu/gpu_extract_1p25b_2026-12-04.json"},
]


def this_gpu() -> str | None:
    """This machine's first NVIDIA GPU's model name, from the driver's /proc files (no torch)."""
    root = Path("/proc/driver/nvidia/gpus")
    try:
        for d in sorted(root.iterdir()):
            for line in (d / "information").read_text().splitlines():
                if line.startswith("Model:"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        return None
    return None


def pick_rate(store, info, dtype: str, deepest: int, gpu: str | None) -> dict | None:
    """The rate to plan with: {tok_per_s (scaled to ``deepest``), device, source}, or None."""
    recorded = read_rates(store).get(shape_key(info, dtype)) or {}
    pick = None
    if recorded:
        device = gpu if gpu in recorded else max(recorded, key=lambda k: recorded[k].get("date", ""))
        r = recorded[device]
        pick = {"tok_per_s": float(r["tok_per_s"]), "measured_deepest": int(r["deepest"]), "device": device,
                "source": f"this store's last extraction of this shape ({r['date']}, {r['tokens']} tokens)"}
    else:
        for r in BENCH_RATES:
            if (r["hybrid"], r["hidden_size"], r["num_layers"], r["dtype"]) == \
                    (info.has_linear_attention, info.hidden_size, info.num_layers, dtype):
                pick = {"tok_per_s": r["tok_per_s"], "measured_deepest": r["deepest"], "device": r["gpu"],
                        "source": f"the GPU bench ({r['source']})"}
                break
    if pick is None:
        return None
    pick["tok_per_s"] *= (pick["measured_deepest"] + 1) / (deepest + 1)
    return pick


def _tokens_of(ctx, tokens_node, positions: list[int]) -> tuple[dict[int, int], bool]:
    """Tokens per position, and whether they are exact (the tokens are stored) or an upper bound."""
    from dfcache.samples import SampleSet, index_of

    have = index_of(ctx.store).partition(tokens_node.partition.key)
    keys = [tokens_node.sample_keys[i] for i in positions]
    if all(k in have for k in keys):
        docs = SampleSet(ctx.store, tokens_node.partition.key, keys).docs()
        return {i: int(d["prompt_len"]) + int(d["completion_len"]) for i, d in zip(positions, docs)}, True
    # not tokenized yet: the prompt's characters (a token holds about 4 of them; fewer would
    # undercount code) plus every token the completion may have
    completions = getattr(tokens_node.spec, "completions", None)
    prompts = getattr(completions.spec, "prompts", None) if completions is not None else None
    records = getattr(prompts.spec, "records", None) if prompts is not None else None
    records = records or []
    max_new = int(getattr(ctx.options, "max_new_tokens", 0) or 0)
    out = {}
    for i in positions:
        rec = records[i] if i < len(records) and isinstance(records[i], dict) else {}
        chars = sum(len(str(m.get("content", ""))) for m in rec.get("messages", []) if isinstance(m, dict))
        out[i] = -(-chars // 4) + max_new
    return out, False


def estimate(ctx, nodes) -> list[dict]:
    """One dict per hidden-states group of the plan (see the module docstring)."""
    from ..models.target import deepest_run, read_model_info, sort_layers

    groups: dict[str, list] = {}
    for n in nodes:
        if n.stage == "hidden_states" and n.partition is not None:
            groups.setdefault(n.group or n.key, []).append(n)
    gpu = this_gpu()
    out = []
    for group in groups.values():
        p = group[0].spec
        info = read_model_info(p.target_dir)
        dtype = p.backend.dtype
        width = info.hidden_size * (4 if dtype == "float32" else 2)
        tokens_node = p.tokens
        todo = {n.spec.layer: n.positions_distinct(n.produce) for n in group}
        positions = sorted({i for ps in todo.values() for i in ps})
        per, exact = _tokens_of(ctx, tokens_node, positions) if positions else ({}, True)
        forward_tokens = sum(per.values())
        stored = sum(per[i] for ps in todo.values() for i in ps) * width
        deepest = deepest_run([k for k, ps in todo.items() if ps] or list(todo), info.num_layers)
        rate = pick_rate(ctx.store, info, dtype, deepest, gpu)
        out.append({
            "target": str(p.target_dir), "backend": p.backend_key(), "layers": sort_layers(todo),
            "samples_to_extract": len(positions), "tokens_to_extract": forward_tokens, "tokens_exact": exact,
            "bytes": {codec: int(stored * r) for codec, r in CODEC_RATIO.items()},
            "bytes_note": "none is exact; the codecs' sizes use the size bench's ratios on tiny-model states",
            "rate": rate, "this_gpu": gpu,
            "hours": (forward_tokens / rate["tok_per_s"] / 3600) if rate and forward_tokens else (0.0 if rate else None),
        })
    return out


def _size(b: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if b < 1000 or unit == "TB":
            return f"{b:.1f} {unit}" if unit != "B" else f"{int(b)} B"
        b /= 1000
    return f"{b:.1f} TB"


def describe(est: list[dict]) -> list[str]:
    lines = []
    if not est:
        return ["estimate: the plan extracts no hidden states"]
    for e in est:
        how = "" if e["tokens_exact"] else " (upper bound: the completions are not tokenized yet; prompt characters / 4 + --max-new-tokens)"
        lines.append(f"estimate for {e['target']} layers {e['layers']} ({e['backend']['kernel']}/{e['backend']['device']}/"
                     f"{e['backend']['dtype']}): {e['samples_to_extract']} sample(s), {e['tokens_to_extract']:,} tokens to "
                     f"extract{how}")
        lines.append("  stored: " + ", ".join(f"{c} {_size(b)}" for c, b in e["bytes"].items())
                     + " (none exact; codecs from the size bench's ratios)")
        r = e["rate"]
        if r is None:
            lines.append("  time: no extraction rate known for this target shape; a first extraction records one")
        else:
            here = f" (this machine: {e['this_gpu']})" if e["this_gpu"] and e["this_gpu"] != r["device"] else ""
            lines.append(f"  time: {e['hours']:.2f} h at {r['tok_per_s']:,.0f} tok/s on {r['device']}{here}, from "
                         f"{r['source']}, scaled to the deepest layer")
    return lines
